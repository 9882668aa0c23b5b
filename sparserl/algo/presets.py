"""Named algorithm presets: plain dicts of AlgoConfig overrides, themselves overridable key by key."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from sparserl.algo.config import AlgoConfig, canonical_keys
from sparserl.algo.losses import POLICY_LOSSES

# The sampling/correction presets share the reference's loss (eps 0.2, beta 1e-4 with k3, seq-mean-token-mean)
# and differ only in how rollouts are sampled and corrected; the last three are dense runs with the losses and
# estimators users of verl look for (combine them with a correction key by key).
PRESETS: dict[str, dict[str, Any]] = {
    # Dense rollouts, plain GRPO: the baseline.
    "dense": {"sparse_rollout": False, "correction_mode": "none"},
    # Sparse rollouts trained as if they were dense: the collapse the paper reports.
    "naive-sparse": {"sparse_rollout": True, "correction_mode": "none"},
    # Sparse-RL reference defaults: veto, token rejection, truncated IS batch-normalised.
    "sparse-rl": {
        "sparse_rollout": True,
        "correction_mode": "decoupled",
        "veto_threshold": 1e-4,
        "token_rs_low": 0.5,
        "token_rs_high": 1.5,
        "tis_cap": 1.5,
        "tis_batch_norm": True,
        "eps_low": 0.2,
        "eps_high": 0.2,
        "kl_coef": 1e-4,
        "kl_estimator": "k3",
    },
    # Token-level truncated IS only, the field's common cap.
    "tis": {"sparse_rollout": True, "correction_mode": "decoupled", "tis_cap": 2.0},
    # IcePop token mask with the field's typical bounds.
    "icepop": {"sparse_rollout": True, "correction_mode": "decoupled", "icepop_low": 0.5, "icepop_high": 5.0},
    # Geometric-mean sequence rejection, wide bounds for compressed rollouts, plus token TIS.
    "geo-rs": {
        "sparse_rollout": True,
        "correction_mode": "decoupled",
        "geo_rs_low": 0.5,
        "geo_rs_high": 2.0,
        "tis_cap": 2.0,
    },
    # Shadow Mask Distillation (arXiv 2605.06850; docs/algorithm.md, "SMD"). Track 1: the PPO loss on the tokens
    # drawn before the sampler first diverged from pi_old (prefix rejection, xi in [0.5, 2.0]; the paper's mask
    # comes from the compression pattern, not from probabilities: the rule and the band are ours), no IS weight.
    # Track 2: lambda = 0.1 (the paper's default) x the authors' one-sided term pulling the dense learner toward
    # the sampler's recorded log-prob of each drawn token, stop-gradient on the sparse side as the paper writes
    # it. The rest is this project's default loss (the authors' runs used other KL, entropy and lr settings).
    "smd": {
        "sparse_rollout": True,
        "correction_mode": "decoupled",
        "prefix_rs_low": 0.5,
        "prefix_rs_high": 2.0,
        "sampler_kl_coef": 0.1,
        "sampler_kl_estimator": "hinge",
    },
    # GSPO: sequence-level ratio, the paper's clip range (v2, section 5.1) and no KL to the reference.
    "gspo": {"policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "kl_coef": 0.0},
    # DAPO's loss: clip-higher (eps_high 0.28), token-level aggregation, no KL. Its dynamic sampling is
    # sampling.dynamic=true and its overlong shaping algo.overlong_buffer (tokens; the paper: 4096 of 20480).
    "dapo": {"eps_low": 0.2, "eps_high": 0.28, "loss_agg_mode": "token-mean", "kl_coef": 0.0},
    # REINFORCE++: raw rewards whitened over the batch; -baseline: group mean subtracted first.
    "reinforce++": {"adv_estimator": "reinforce", "adv_transforms": ["batch_whiten"]},
    "reinforce++-baseline": {"adv_estimator": "drgrpo", "adv_transforms": ["batch_whiten"]},
    # CISPO (MiniMax-M1): the clipped IS weight detached, every token keeps its gradient; no lower bound in the
    # paper (eps_low 0.99 is the nearest here, docs/algorithm.md), token-level aggregation, no KL. eps_high stays
    # the run's (the paper tunes it).
    "cispo": {"policy_loss": "cispo", "eps_low": 0.99, "loss_agg_mode": "token-mean", "kl_coef": 0.0},
}

# Presets that set only the loss or the advantages, never how rollouts are sampled and corrected: on top of any
# rollout preset (the others), one of each joined by '+', e.g. 'sparse-rl+gspo'.
LOSS_PRESETS = ("gspo", "dapo", "reinforce++", "reinforce++-baseline", "cispo")
PRESET_JOIN = "+"


def preset_names(chain: str) -> list[str]:
    """The presets of `chain` ('sparse-rl', 'gspo', 'sparse-rl+gspo'): at most one rollout preset, then at
    most one loss preset; ValueError naming the presets, and algo.policy_loss for a loss alone."""
    names = _split(str(chain))
    unknown = [n for n in names if n not in PRESETS]
    rollout = [n for n in names if n in PRESETS and n not in LOSS_PRESETS]
    loss = [n for n in names if n in LOSS_PRESETS]
    if not names or unknown or len(rollout) > 1 or len(loss) > 1:
        what = f"{unknown[0]!r} is unknown" if unknown else "combines two presets of one kind"
        what = what if names else "names no preset"
        raise ValueError(
            f"{chain!r}: {what}. Rollout presets (how rollouts are sampled and corrected): "
            f"{', '.join(n for n in PRESETS if n not in LOSS_PRESETS)}; loss presets: {', '.join(LOSS_PRESETS)}; "
            f"one of each joins with '{PRESET_JOIN}' (e.g. sparse-rl{PRESET_JOIN}gspo). A loss on its own is "
            f"algo.policy_loss=NAME ({', '.join(POLICY_LOSSES)})"
        )
    return rollout + loss


def _split(chain: str) -> list[str]:
    """The names of a chain, each the longest preset name it starts with ('reinforce++' holds the joiner)."""
    names, rest = [], re.sub(r"\s*\+\s*", PRESET_JOIN, chain.strip())
    while rest:
        ends = [n for n in PRESETS if rest == n or rest.startswith(n + PRESET_JOIN)]
        name = max(ends, key=len) if ends else rest.split(PRESET_JOIN, 1)[0] or rest
        names.append(name)
        rest = rest[len(name) + 1 :]
    return names


def merge_presets(old: str, new: str) -> str:
    """`new` set over `old` (algo.preset on the command line over the config file's): the kinds `new` names
    replace `old`'s, the others stay, so a loss preset keeps the run's rollout method and corrections."""
    before, after = preset_names(old), preset_names(new)
    kinds = {m in LOSS_PRESETS for m in after}
    kept = [n for n in before if (n in LOSS_PRESETS) not in kinds]
    return PRESET_JOIN.join(sorted(kept + after, key=lambda n: n in LOSS_PRESETS))


def preset_values(chain: str, base: str | None = None) -> tuple[str, dict[str, Any]]:
    """The canonical chain and the AlgoConfig values of `chain`, its presets applied in order (rollout, then
    loss); `base`, when given, is the rollout preset of a chain that names none."""
    names = preset_names(chain)
    if base is not None and all(n in LOSS_PRESETS for n in names):
        names = [base, *names]
    values: dict[str, Any] = {}
    for name in names:  # lists copied: no sharing with the table
        values.update({k: list(v) if isinstance(v, list) else v for k, v in PRESETS[name].items()})
    return PRESET_JOIN.join(names), values


def algo_config(preset: str = "dense", **overrides: Any) -> AlgoConfig:
    """Build an AlgoConfig from a named preset (or a chain, 'tis+gspo'), then apply `overrides` key by key."""
    overrides = canonical_keys(overrides)
    valid = {f.name for f in fields(AlgoConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"unknown algo config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(valid))}"
        )
    return AlgoConfig(**{**preset_values(preset)[1], **overrides})
