"""The algorithm half: advantages, Sparse-RL corrections, the policy loss (tensors in, tensors and metrics out).

Typical use per batch of rollouts (mask = response mask, [B, T]):

    adv = advantages(rewards, group_index, cfg.adv_estimator)               # before any rejection
    ref = correction_reference(logp_old, logp, cfg)                           # pi_old; the learner's in bypass
    w, keep, m1 = correction_weights(ref, logp_sampler, mask, cfg, adv)
    loss, m2 = policy_loss(logp, ppo_anchor(logp_old, logp_sampler, cfg), adv, keep, w, cfg, logp_ref)

SMD (preset smd) in one call: `smd_loss(logp, logp_old, logp_sampler, mask, adv)` (algo/smd.py).
The surrogate is `cfg.policy_loss` (POLICY_LOSSES: ppo_clip, gspo, cispo, soft_sapo, clip_cov, kl_cov); the
masks on its term and the truncated-completion mask are in algo/token_masks.py; verl's rejection names map to the
rules through `cfg.rollout_rs` (rollout_rs_overrides).
"""

from sparserl.algo import tree as _tree  # noqa: F401 - registers the 'tree' transform
from sparserl.algo import uniqueness as _uniqueness  # noqa: F401 - registers the 'uniqueness' transform
from sparserl.algo.acceptance import (
    AcceptanceBin,
    acceptance_by_bin,
    acceptance_exact,
    acceptance_metrics,
    acceptance_topk,
)
from sparserl.algo.advantages import (
    ADV_ESTIMATORS,
    ADV_TRANSFORMS,
    AdvantageTransform,
    TransformContext,
    advantages,
    advantages_from_config,
    grpo_advantages,
    make_adv_transforms,
    register_adv_transform,
)
from sparserl.algo.config import AlgoConfig
from sparserl.algo.corrections import correction_reference, correction_weights, ppo_anchor
from sparserl.algo.loss import aggregate, kl_penalty, loss_denominator, policy_loss
from sparserl.algo.losses import POLICY_LOSSES, register_policy_loss
from sparserl.algo.presets import PRESETS, algo_config
from sparserl.algo.rs_aliases import rollout_rs_overrides
from sparserl.algo.smd import smd_loss

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_TRANSFORMS",
    "POLICY_LOSSES",
    "PRESETS",
    "AdvantageTransform",
    "TransformContext",
    "AcceptanceBin",
    "AlgoConfig",
    "acceptance_by_bin",
    "acceptance_exact",
    "acceptance_metrics",
    "acceptance_topk",
    "advantages",
    "advantages_from_config",
    "make_adv_transforms",
    "aggregate",
    "algo_config",
    "correction_reference",
    "correction_weights",
    "grpo_advantages",
    "kl_penalty",
    "loss_denominator",
    "policy_loss",
    "ppo_anchor",
    "register_adv_transform",
    "register_policy_loss",
    "rollout_rs_overrides",
    "smd_loss",
]
