"""Shadow Mask Distillation (SMD, arXiv 2605.06850) as one loss call: the competitor's estimator, for a tool that
needs its update next to the others' (one more backward per batch).

SMD = Track 1 + lambda x Track 2 (docs/algorithm.md, "SMD"):
- Track 1, the policy gradient on the tokens the sparse sampler drew faithfully: here the PPO loss on the tokens
  before the first one of its sequence whose xi = pi_old / pi_sparse leaves [prefix_rs_low, prefix_rs_high]
  (`corrections.prefix_rs`), no IS weight;
- Track 2, the distillation term D(pi_dense || sg(pi_sparse)) over every response token: the dense learner, with
  gradient, pulled toward the sampler's recorded log-prob of the drawn token (`loss.sampler_kl`).
Both are AlgoConfig knobs, so the trainer runs SMD through its usual `correction_weights` + `policy_loss` with
`algo.preset=smd`; this module only bundles the two calls.
"""

from __future__ import annotations

from torch import Tensor

from sparserl.algo.config import AlgoConfig
from sparserl.algo.corrections import correction_reference, correction_weights, ppo_anchor
from sparserl.algo.loss import policy_loss
from sparserl.algo.presets import algo_config


def smd_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_sampler: Tensor,
    mask: Tensor,
    advantages: Tensor,
    cfg: AlgoConfig | None = None,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    *,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The SMD loss of one batch, to minimise, and its metrics.

    Args:
        logp: [B, T] log pi_theta of the sampled tokens from the dense learner, with gradient.
        logp_old: [B, T] dense pi_old (teacher-forced, detached): the PPO anchor and the reference of xi.
        logp_sampler: [B, T] the sparse sampler's recorded log-probs of the same tokens (detached): the
            faithful-token test and Track 2's target. No sparse-path gradient is needed: the paper stops it.
        mask: [B, T] response mask (1 = a generated token).
        advantages: [B] or [B, T], detached.
        cfg: the settings; None: `algo_config("smd")`. Its kl_coef (1e-4 by default) needs `logp_ref`; pass
            `algo_config("smd", kl_coef=0.0)` to leave the reference out.
        logp_ref: [B, T] reference-model log-probs, when cfg.kl_coef > 0.
        entropy: [B, T] the learner's entropy with gradient, when cfg.entropy_coef > 0.
        denominator: as in `policy_loss` (None: this batch's own count).

    Returns:
        The scalar loss (Track 1 over the kept tokens + sampler_kl_coef x Track 2 over every response token, plus
        the config's reference KL and entropy terms) and the metrics of `correction_weights` ('rollout_corr/...',
        among them prefix_rs_masked_fraction) and of `policy_loss` ('actor/...', among them sampler_kl).
    """
    cfg = algo_config("smd") if cfg is None else cfg
    ref = correction_reference(logp_old, logp, cfg)
    weights, keep, corr = correction_weights(ref, logp_sampler, mask, cfg, advantages)
    loss, metrics = policy_loss(
        logp, ppo_anchor(logp_old, logp_sampler, cfg), advantages, mask.bool() & keep, weights, cfg,
        logp_ref, entropy, response_mask=mask, denominator=denominator, logp_sampler=logp_sampler,
    )  # fmt: skip
    return loss, {**corr, **metrics}
