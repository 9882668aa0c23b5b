"""Named algorithm presets: plain dicts of AlgoConfig overrides, themselves overridable key by key."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from sparserl.algo.config import AlgoConfig

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
}


def algo_config(preset: str = "dense", **overrides: Any) -> AlgoConfig:
    """Build an AlgoConfig from a named preset, then apply `overrides` key by key."""
    if preset not in PRESETS:
        raise ValueError(f"unknown algo preset {preset!r}; choose one of {', '.join(PRESETS)}")
    valid = {f.name for f in fields(AlgoConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"unknown algo config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(valid))}"
        )
    preset_values = {
        k: list(v) if isinstance(v, list) else v for k, v in PRESETS[preset].items()
    }  # no sharing
    return AlgoConfig(**{**preset_values, **overrides})
