"""The distill section: DistillSparse (Sparrow), a LoRA adapter that exists only on the sparse rollout path and is
distilled from the dense policy to close the gap between the sparse sampler and it (no reward term)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparserl.algo.distill import DIVERGENCES, TAIL_WEIGHTS
from sparserl.config.errors import ConfigError


@dataclass
class DistillConfig:
    """A second LoRA adapter, on while sampling with block-sparse attention and off everywhere else."""

    enable: bool = field(
        default=False,
        metadata={
            "help": "DistillSparse: add a LoRA adapter that is on only while sampling sparse (and in its "
            "teacher-forced replay), off in dense scoring, the reference and the policy loss. Each step, after "
            "the policy update, the adapter alone is distilled from the dense policy (as updated) on the step's "
            "sparse samples: a full-vocabulary divergence per token (distill.divergence), tail-weighted "
            "(distill.tail_weight); no reward or advantage. Needs sparse rollouts (block_topk, whose reads are "
            "replayed from the queries, or an eviction method, whose held positions are recorded for the replay)."
        },
    )
    adapter_name: str = field(
        default="distill",
        metadata={"help": "PEFT name of the adapter; it must differ from the policy's own ('default')."},
    )
    lora_r: int = field(default=32, metadata={"help": "Rank of the adapter."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha of the adapter."})
    lora_targets: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Modules that get the adapter (comma-separated), or 'all-linear'."},
    )
    lr: float = field(
        default=5e-5,
        metadata={
            "help": "The adapter's learning rate (constant, its own: not tied to the policy's). Choose it by "
            "held-out P5 on calibration prompts (experiments/distill_sparse.py sweeps it), not by reward."
        },
    )
    divergence: str = field(
        default="tv",
        metadata={
            "help": "Per-token divergence between the sparse path and the dense policy over the whole "
            "vocabulary: tv (total variation = 1 - alpha, what P5 reads) or forward_kl (KL(dense || sparse))."
        },
    )
    tail_weight: str = field(
        default="tv",
        metadata={
            "help": "Token weights: none (all 1), tv (proportional to 1 - alpha, mean 1) or lowest (the "
            "distill.tail_fraction of lowest-alpha tokens per trainer.acceptance_bin position bin)."
        },
    )
    tail_fraction: float = field(
        default=0.2,
        metadata={"help": "With distill.tail_weight=lowest: the fraction of tokens weighted, (0, 1]."},
    )
    probe_samples: int = field(
        default=8,
        metadata={
            "help": "Size of the fixed probe batch (the first rollouts of the run, kept in the checkpoint) on "
            "which alpha's tail per bin is measured before and after each adapter update; 0: no probe."
        },
    )
    probe_every: int = field(default=1, metadata={"help": "Measure the probe every this many steps (>= 1)."})
    fresh_on_resume: bool = field(
        default=False,
        metadata={
            "help": "Resuming a checkpoint saved without the adapter (distill was off): start a fresh adapter "
            "(and its optimizer) instead of refusing."
        },
    )

    def __post_init__(self) -> None:
        if self.lora_r < 1:
            raise ConfigError(f"distill.lora_r={self.lora_r} must be >= 1")
        if not self.adapter_name or not self.adapter_name.isidentifier():
            raise ConfigError(f"distill.adapter_name={self.adapter_name!r} must be a Python identifier")
        if not self.lora_targets:
            raise ConfigError("distill.lora_targets is empty: name the modules that get the adapter")
        if self.lr <= 0:
            raise ConfigError(f"distill.lr={self.lr} must be > 0")
        if self.divergence not in DIVERGENCES:
            raise ConfigError(
                f"distill.divergence={self.divergence!r}: choose one of {', '.join(DIVERGENCES)}"
            )
        if self.tail_weight not in TAIL_WEIGHTS:
            raise ConfigError(
                f"distill.tail_weight={self.tail_weight!r}: choose one of {', '.join(TAIL_WEIGHTS)}"
            )
        if not 0 < self.tail_fraction <= 1:
            raise ConfigError(f"distill.tail_fraction={self.tail_fraction} must be in (0, 1]")
        if self.probe_samples < 0 or self.probe_every < 1:
            raise ConfigError(
                f"distill.probe_samples={self.probe_samples} must be >= 0 and "
                f"distill.probe_every={self.probe_every} >= 1"
            )
