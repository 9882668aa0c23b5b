"""The policy loss: the `algo.policy_loss` surrogate (PPO clip by default; GSPO, CISPO in algo/losses.py) times IS
weights, masked aggregation, KL and entropy."""

from __future__ import annotations

import torch
from torch import Tensor

from sparserl.algo.config import AlgoConfig
from sparserl.algo.losses import POLICY_LOSSES, ppo_clip
from sparserl.algo.masked import (
    as_mask,
    check_2d,
    masked_fill_safe,
    masked_max,
    masked_mean,
    to_floats,
    upcast,
)
from sparserl.algo.token_masks import PgInputs, pg_keep

PREFIX = "actor/"


def loss_denominator(mask: Tensor, cfg: AlgoConfig, response_mask: Tensor | None = None) -> float:
    """The count `policy_loss` divides by, for a whole (global) batch.

    Sequence modes: number of sequences (all rows if cfg.rejected_in_denominator, else rows with a kept
    token). token-mean: number of tokens (of `response_mask` if cfg.rejected_in_denominator and it is given,
    else of `mask`). Compute it once on the global batch and pass it as `denominator` to every micro-batch's
    `policy_loss` so that the micro-batch losses add up to the global one.
    """
    m = mask.bool()
    if cfg.loss_agg_mode == "token-mean":
        src = response_mask.bool() if (cfg.rejected_in_denominator and response_mask is not None) else m
        return float(src.sum())
    return float(m.shape[0] if cfg.rejected_in_denominator else m.any(dim=1).sum())


def aggregate(
    x: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    response_mask: Tensor | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Reduce per-token values `x` [B, T] over `mask` to a scalar, following cfg.loss_agg_mode.

    - seq-mean-token-mean: (1/D) sum_i [ sum_t m x / max(1, sum_t m) ]   (the reference)
    - token-mean:          (1/D) sum_{i,t} m x
    - seq-mean-token-sum-norm: (1/D) sum_i [ sum_t m x / L ], L = cfg.loss_token_norm or T  (Dr. GRPO)
    with D = `denominator` if given, else `loss_denominator` of this batch (at least 1).
    """
    m = mask.bool()
    xm = masked_fill_safe(x, m)
    d = loss_denominator(m, cfg, response_mask) if denominator is None else float(denominator)
    d = max(d, 1.0)
    if cfg.loss_agg_mode == "token-mean":
        return xm.sum() / d
    if cfg.loss_agg_mode == "seq-mean-token-mean":
        per_seq = xm.sum(dim=1) / m.sum(dim=1).clamp_min(1).to(xm.dtype)
    else:
        per_seq = xm.sum(dim=1) / float(cfg.loss_token_norm or m.shape[1])
    return per_seq.sum() / d


def kl_penalty(
    logp: Tensor, logp_ref: Tensor, estimator: str, clamp: float, logp_old: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta, clamped to [-clamp, clamp].

    k1 = log pi - log pi_ref; k2 = (k1)^2 / 2; k3 = exp(-k1) + k1 - 1 (unbiased, >= 0, low variance).
    k3_is = r k3 with r = pi_theta / pi_old (log clamped to +-clamp, with its gradient): DeepSeek-V3.2's
    estimate for samples of pi_old, unbiased in value, its gradient r grad log pi_theta log(pi_theta / pi_ref)
    that of the KL.
    """
    d = logp - logp_ref
    if estimator == "k3_is":
        if logp_old is None:
            raise ValueError("kl estimator 'k3_is' needs logp_old (the pi_old the tokens were sampled under)")
        ratio = (logp - logp_old).clamp(-clamp, clamp).exp()
        return (ratio * kl_penalty(logp, logp_ref, "k3", clamp)).clamp(-clamp, clamp)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    elif estimator == "k3":
        kl = torch.exp((-d).clamp(max=clamp + 1.0)) + d - 1.0  # exp bounded so kl never overflows to inf
    else:
        raise ValueError(f"kl estimator {estimator!r} is unknown; choose one of k1, k2, k3, k3_is")
    return kl.clamp(-clamp, clamp)


def sampler_kl(logp: Tensor, logp_sampler: Tensor, estimator: str, clamp: float) -> Tensor:
    """Per-token divergence of the learner from the sampler on the drawn token, SMD's distillation term; the
    sampler's log-prob is a fixed target (detached), so the gradient goes to the learner only.

    hinge = max(0, log pi_sparse - log pi_theta) (the SMD authors' released code: only where the learner gives
    the drawn token less than the sampler did); kl = rho log rho - rho + 1 with rho = pi_theta / pi_sparse,
    log rho clamped to [-clamp, clamp]: >= 0, and on the sampler's draws its mean and its gradient's are
    KL(pi_theta || pi_sparse) at the prefix and that KL's gradient.
    """
    d = logp - logp_sampler.detach()
    if estimator == "hinge":
        return torch.relu(-d)  # gradient 0, not -1, where the two agree exactly
    if estimator == "kl":
        d = d.clamp(-clamp, clamp)
        return d.exp() * (d - 1.0) + 1.0
    raise ValueError(f"sampler kl estimator {estimator!r} is unknown; choose one of hinge, kl")


def policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    cfg: AlgoConfig,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    *,
    response_mask: Tensor | None = None,
    denominator: float | None = None,
    logp_sampler: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of one (micro-)batch, to minimise.

    r_t = exp(clamp(log pi_theta - log pi_old)),
    pg_t = w_t * max(-r_t A, -clip(r_t, 1 - eps_low, 1 + eps_high) A), capped at -c A for A < 0 (dual clip),
    loss = agg(pg) + beta * agg(kl(pi_theta || pi_ref)) - entropy_coef * agg(entropy)
           + sampler_kl_coef * agg_response(sampler_kl(pi_theta, pi_sparse))   (SMD; over every response token).
    That is cfg.policy_loss='ppo_clip'; the others replace the surrogate (algo/losses.py), and the masks of
    algo/token_masks.py (off_policy_mask_threshold, top_entropy_quantile) drop pg_t where they fire.

    Args:
        logp: [B, T] log pi_theta of the sampled tokens, with gradient.
        logp_old: [B, T] the PPO anchor: dense pi_old (decoupled / none) or the sampler's (bypass); detached.
        advantages: [B] per sequence (broadcast to its tokens) or [B, T] per token; detached.
        mask: [B, T] the loss mask = response mask * keep_mask of `correction_weights` (rejected tokens and
            every token of a rejected sequence are 0). A 0 token contributes nothing, whatever its values
            (even inf/NaN), and receives zero gradient.
        weights: [B, T] detached IS weights (>= 0) from `correction_weights`; None means all ones.
        cfg: clip, dual clip, aggregation, KL and entropy settings.
        logp_ref: [B, T] reference-model log-probs; required when cfg.kl_coef > 0.
        entropy: [B, T] per-token entropy of pi_theta, with gradient; required when cfg.entropy_coef > 0.
        response_mask: [B, T] response tokens before rejection; with token-mean and
            cfg.rejected_in_denominator, rejected tokens then count in the denominator.
        denominator: divide by this instead of this batch's own count (see `loss_denominator`).
        logp_sampler: [B, T] the sampler's recorded log-probs; required when cfg.sampler_kl_coef > 0, whose term
            covers `response_mask` (or `mask` when that is None), rejected tokens included.

    Returns the scalar loss and metrics keyed 'actor/<name>' (token statistics over the kept tokens).
    """
    m, response_mask, advantages = _checked(logp, mask, advantages, logp_old, weights, logp_ref, entropy,
                                            logp_sampler, response_mask)  # fmt: skip
    lp = masked_fill_safe(upcast(logp), m)
    old = masked_fill_safe(upcast(logp_old.detach()), m)
    adv = masked_fill_safe(upcast(advantages.detach()), m)
    w = _importance_weights(weights, lp, m)
    pg, ratio, clipped, dual = POLICY_LOSSES.lookup(cfg.policy_loss)(lp, old, adv, m, cfg)
    keep_pg, masked = pg_keep(PgInputs(lp, adv, m, entropy, logp_sampler), cfg)  # algo/token_masks.py
    pg_tok = w * pg if keep_pg is None else torch.where(keep_pg, w * pg, torch.zeros_like(pg))

    agg = {"response_mask": response_mask, "denominator": denominator}
    pg_loss = aggregate(pg_tok, m, cfg, **agg)
    loss = pg_loss
    metrics: dict[str, Tensor | float] = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": masked_mean(clipped.float(), m),
        "pg_clipfrac_lower": masked_mean(dual.float(), m),
        "ppo_kl": masked_mean((old - lp).detach(), m),
        "ratio_mean": masked_mean(ratio.detach(), m, empty=1.0),
        "ratio_max": masked_max(ratio.detach(), m, empty=1.0),
        "kept_tokens": m.sum().float(),
        **masked,
    }

    extra, more = _regularisers(logp, lp, old, m, cfg, agg, logp_ref, entropy, logp_sampler, response_mask)
    loss = loss + extra
    metrics.update(more)
    metrics["loss"] = loss.detach()
    return loss, {PREFIX + k: v for k, v in to_floats(metrics).items()}


def _regularisers(
    logp: Tensor,
    lp: Tensor,
    old: Tensor,
    m: Tensor,
    cfg: AlgoConfig,
    agg: dict,
    logp_ref: Tensor | None,
    entropy: Tensor | None,
    logp_sampler: Tensor | None,
    response_mask: Tensor | None,
) -> tuple[Tensor | float, dict[str, Tensor]]:
    """What the KL to the reference, the entropy bonus and SMD's pull toward the sampler add to the loss (0 when
    all are off), and their metrics; `lp` is `logp` upcast and zero off the loss mask `m`, `old` the PPO anchor
    (k3_is weighs the KL by pi_theta / pi_old)."""
    loss: Tensor | float = 0.0
    metrics: dict[str, Tensor] = {}
    if cfg.kl_coef > 0 and logp_ref is None:
        raise ValueError(f"algo.kl_coef={cfg.kl_coef} > 0 needs logp_ref (log-probs of the reference model)")
    if logp_ref is not None:
        ref = masked_fill_safe(upcast(logp_ref.detach()), m)
        kl_loss = aggregate(kl_penalty(lp, ref, cfg.kl_estimator, cfg.kl_clamp, old), m, cfg, **agg)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_ref"] = kl_loss.detach()

    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"algo.entropy_coef={cfg.entropy_coef} > 0 needs the per-token entropy")
    if entropy is not None:
        ent = aggregate(masked_fill_safe(upcast(entropy), m), m, cfg, **agg)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
        metrics["entropy"] = ent.detach()

    if cfg.sampler_kl_coef > 0:
        if logp_sampler is None:
            raise ValueError(
                f"algo.sampler_kl_coef={cfg.sampler_kl_coef} > 0 needs logp_sampler (the sampler's log-probs)"
            )
        resp = m if response_mask is None else response_mask
        lp_all = masked_fill_safe(upcast(logp), resp)
        samp = masked_fill_safe(upcast(logp_sampler.detach()), resp)
        skl_tok = sampler_kl(lp_all, samp, cfg.sampler_kl_estimator, cfg.log_ratio_clamp)
        skl = aggregate(skl_tok, resp, cfg, **agg)
        loss = loss + cfg.sampler_kl_coef * skl
        metrics["sampler_kl"] = skl.detach()

    return loss, metrics


def _checked(
    logp: Tensor, mask: Tensor, advantages: Tensor, *others: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor]:
    """`policy_loss`'s inputs checked: the bool loss mask, the response mask (None stays None) and the
    advantages broadcast to [B, T]; `others` (logp_old, weights, logp_ref, entropy, logp_sampler,
    response_mask) must be logp's shape where given."""
    check_2d("logp", logp)
    m = as_mask(mask, logp)
    *same, response_mask = others
    for name, t in zip(("logp_old", "weights", "logp_ref", "entropy", "logp_sampler"), same, strict=True):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected logp's {tuple(logp.shape)}")
    if response_mask is not None:
        response_mask = as_mask(response_mask, logp, "response_mask")
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        advantages = advantages[:, None].expand_as(logp)
    elif advantages.shape != logp.shape:
        raise ValueError(
            f"advantages have shape {tuple(advantages.shape)}, expected [B] or {tuple(logp.shape)}"
        )
    return m, response_mask, advantages


def clipped_pg(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate per token, max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), capped at -c A
    for A < 0 (dual clip); returns it, the ratio r, and where the clip and the dual clip acted (on `m`).
    The 'ppo_clip' entry of `POLICY_LOSSES` (algo/losses.py)."""
    return ppo_clip(lp, old, adv, m, cfg)


def _importance_weights(weights: Tensor | None, lp: Tensor, m: Tensor) -> Tensor:
    """The detached IS weights on the loss mask (all ones when None); negative ones are an error."""
    w = torch.ones_like(lp) if weights is None else masked_fill_safe(upcast(weights.detach()), m)
    if bool((w < 0).any()):
        raise ValueError("weights must be >= 0 on the loss mask (importance weights)")
    return w
