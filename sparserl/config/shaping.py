"""The shaping section: an advantage transform applied after `algo.adv_transforms`, with its options. Today
that is uniqueness-aware advantages ("Rewarding the Rare", docs/uniqueness.md): correct rollouts whose
solution strategy is rare within their group weigh more than those of a crowded strategy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sparserl.config.errors import ConfigError

MODES = ("advantage", "reward")


@dataclass
class ShapingConfig:
    """Which transform shapes the advantages after algo.adv_transforms, and how (docs/uniqueness.md)."""

    method: str = field(
        default="none",
        metadata={
            "help": "An advantage transform (algo/advantages.py ADV_TRANSFORMS) applied after "
            "algo.adv_transforms, or 'none'. 'uniqueness': weight each correct rollout (reward > 0) by "
            "|C|^-alpha, |C| the size of its solution-strategy cluster among its group's correct rollouts."
        },
    )
    alpha: float = field(
        default=0.5,
        metadata={
            "help": "Uniqueness: the exponent of the weight |C|^-alpha (>= 0). 0 leaves the advantages exactly "
            "as they were; 1 gives a rollout of a strategy shared by 4 a quarter of a unique one's weight."
        },
    )
    mode: str = field(
        default="advantage",
        metadata={
            "help": "Uniqueness: 'advantage' multiplies each advantage by its weight (token-level rows "
            "included); 'reward' multiplies the rewards of correct rollouts by it and recomputes the "
            "advantages with algo.adv_estimator and algo.adv_transforms."
        },
    )
    judge: str = field(
        default="rule",
        metadata={
            "help": "Uniqueness: who clusters a group's correct rollouts by strategy. 'rule': the arithmetic "
            "skeleton of the text (numbers and wording dropped, operators in order), deterministic; "
            "'embedding': the policy's mean last hidden state, cosine distance, average-linkage "
            "clustering cut at judge_threshold; 'llm': the policy asked, greedily, for a JSON list of "
            "strategy labels (a malformed answer: no reweighting for that group, counted)."
        },
    )
    judge_threshold: float = field(
        default=0.1,
        metadata={
            "help": "Embedding judge: clusters merge while their average cosine distance (0..2) is <= this "
            "(>= 0; 0: only identical texts share a cluster)."
        },
    )
    judge_max_new_tokens: int = field(
        default=64,
        metadata={"help": "LLM judge: tokens the judge may generate for its JSON list of labels (>= 1)."},
    )

    def __post_init__(self) -> None:
        if not 0 <= self.alpha < math.inf:
            raise ConfigError(f"shaping.alpha={self.alpha} must be a finite number >= 0")
        if self.mode not in MODES:
            raise ConfigError(f"shaping.mode={self.mode!r}: choose one of {', '.join(MODES)}")
        if not 0 <= self.judge_threshold < math.inf:
            raise ConfigError(f"shaping.judge_threshold={self.judge_threshold} must be a finite number >= 0")
        if self.judge_max_new_tokens < 1:
            raise ConfigError(f"shaping.judge_max_new_tokens={self.judge_max_new_tokens} must be >= 1")
        self._check_names()

    def _check_names(self) -> None:
        """`method` and `judge` against their registries, imported only now (they import torch)."""
        from sparserl.algo.advantages import ADV_TRANSFORMS
        from sparserl.algo.uniqueness import known_judges

        if self.method != "none" and self.method not in ADV_TRANSFORMS:
            raise ConfigError(
                f"shaping.method={self.method!r} is unknown; choose 'none' or one of {', '.join(ADV_TRANSFORMS)}"
            )
        if self.judge not in known_judges():
            raise ConfigError(
                f"shaping.judge={self.judge!r} is unknown; choose one of {', '.join(known_judges())}"
            )
