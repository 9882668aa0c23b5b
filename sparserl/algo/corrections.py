"""Sparse-RL corrections: importance weights and rejection masks for rollouts sampled on a compressed KV cache.

The sparsity consistency ratio is xi_t = pi_old(o_t) / pi_sparse(o_t), computed in log space and clamped to
+-cfg.log_ratio_clamp before exp (sparse-rl.md section 3; r_t in field.md). Every diagnostic metric is taken
on xi (or the unclamped log-ratio) over the response tokens passed in, *before* truncation, rejection or
batch normalisation, so a correction never hides the mismatch it corrects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl.algo.config import AlgoConfig
from sparserl.algo.masked import (
    as_mask,
    check_2d,
    masked_fill_safe,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    to_floats,
    upcast,
)
from sparserl.algo.mismatch import backend_mismatch
from sparserl.algo.rs_aliases import ALIASES as VERL_RS_ALIASES  # noqa: F401  verl's rollout_rs names
from sparserl.algo.rs_aliases import NO_EQUIVALENT as VERL_RS_NO_EQUIVALENT  # noqa: F401
from sparserl.algo.rs_aliases import rollout_rs_overrides  # noqa: F401  (algo.rollout_rs)

PREFIX = "rollout_corr/"


def _log(bound: float) -> float:
    return math.log(bound) if bound > 0 else float("-inf")


def _outside(log_x: Tensor, low: float | None, high: float | None) -> tuple[Tensor, Tensor]:
    """(below low, above high) in log space; bounds are inclusive-kept; a None bound never fires."""
    below = log_x < _log(low) if low is not None else torch.zeros_like(log_x, dtype=torch.bool)
    above = log_x > _log(high) if high is not None else torch.zeros_like(log_x, dtype=torch.bool)
    return below, above


def ppo_anchor(logp_old: Tensor | None, logp_sampler: Tensor, cfg: AlgoConfig) -> Tensor:
    """The log-probs the PPO ratio is taken against: the sampler's in bypass mode, dense pi_old otherwise."""
    if cfg.correction_mode == "bypass" or logp_old is None:
        if cfg.correction_mode != "bypass":
            raise ValueError(
                f"algo.correction_mode={cfg.correction_mode!r} needs the recomputed dense logp_old"
            )
        return logp_sampler
    return logp_old


def correction_reference(logp_old: Tensor | None, logp_learner: Tensor, cfg: AlgoConfig) -> Tensor:
    """The log-probs the corrections compare with the sampler's: dense pi_old in decoupled mode; in bypass
    mode (no pi_old) the learner's own, detached, as the field defines bypass (field.md). Comparing the
    sampler with itself would make xi = 1 and switch every correction and mismatch metric off silently."""
    if cfg.correction_mode == "bypass":
        return logp_learner.detach()
    if logp_old is None:
        raise ValueError(f"algo.correction_mode={cfg.correction_mode!r} needs the recomputed dense logp_old")
    return logp_old


@dataclass(frozen=True)
class Ratios:
    """One batch's log-probs and sparsity ratios, what every rule reads. [B, T] unless noted; values at masked
    positions are zeros, never garbage."""

    old: Tensor  # log pi_old (the correction reference)
    samp: Tensor  # log pi_sparse recorded by the sampler
    raw: Tensor  # unclamped log xi; -inf where pi_old gives the sampled token no mass (never NaN)
    log_xi: Tensor  # log xi clamped to [-clamp, clamp] per token (sparse-rl.md section 3)
    xi: Tensor  # exp(log_xi)
    valid: Tensor  # bool response mask
    n_tok: Tensor  # [B] response tokens per sequence
    has_tokens: Tensor  # [B] rows with at least one response token
    seq_log_xi: Tensor  # [B] sum over a sequence of its clamped per-token log xi
    clamp: float
    advantages: Tensor | None = None  # [B] or [B, T], for the sign-aware rules


@dataclass(frozen=True)
class Verdict:
    """What one rejection rule decides: the tokens ([B, T]) or sequences ([B]) it drops, an optional factor
    [B] on the sequences' IS weights, and its metrics (names without the 'rollout_corr/' prefix)."""

    drop: Tensor
    metrics: dict[str, Tensor]
    seq_weight: Tensor | None = None


def log_ratios(
    logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, clamp: float, advantages: Tensor | None = None
) -> Ratios:
    """Check the inputs and compute the ratios the rules share (raises naming the first unusable token)."""
    check_2d("logp_old", logp_old)
    if logp_sampler.shape != logp_old.shape:
        raise ValueError(
            f"logp_sampler has shape {tuple(logp_sampler.shape)}, expected logp_old's {tuple(logp_old.shape)}"
        )
    valid = as_mask(mask, logp_old)
    old = masked_fill_safe(upcast(logp_old.detach()), valid)
    samp = masked_fill_safe(upcast(logp_sampler.detach()), valid)
    bad = valid & ~(torch.isfinite(samp) & ~torch.isnan(old) & (old < float("inf")))
    if bool(bad.any()):
        where = torch.nonzero(bad)[0].tolist()
        raise ValueError(
            f"log-probs are not usable at response token [seq {where[0]}, pos {where[1]}]: "
            f"logp_sampler={float(samp[where[0], where[1]])}, logp_old={float(old[where[0], where[1]])} "
            "(the sampler's log-prob of a sampled token must be finite; logp_old must not be NaN)"
        )
    raw = masked_fill_safe(old - samp, valid)
    log_xi = raw.clamp(-clamp, clamp)
    n_tok = valid.sum(dim=1)
    return Ratios(
        old, samp, raw, log_xi, log_xi.exp(), valid, n_tok, n_tok > 0, masked_sum(log_xi, valid, dim=1), clamp,
        advantages,
    )  # fmt: skip


# ---- token IS weights ----------------------------------------------------------------------------------------


def token_is_weights(r: Ratios, cfg: AlgoConfig) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Token TIS (w = min(xi, cap)) and IcePop (w = xi inside [low, high], else 0 and dropped): the weights
    before rejection (they define the batch-normalisation factor), the tokens IcePop drops, metrics."""
    m: dict[str, Tensor] = {}
    icepop = cfg.icepop_low is not None or cfg.icepop_high is not None
    weight = r.xi if cfg.tis_cap is not None or icepop else torch.ones_like(r.xi)
    dropped = torch.zeros_like(r.valid)
    if cfg.tis_cap is not None:
        weight = weight.clamp(max=cfg.tis_cap)
        m["tis_truncated_fraction"] = masked_mean((r.log_xi > _log(cfg.tis_cap)).float(), r.valid)
    if icepop:
        lo, hi = _outside(r.log_xi, cfg.icepop_low, cfg.icepop_high)
        dropped = lo | hi
        weight = torch.where(dropped, torch.zeros_like(weight), weight)
        m["icepop_masked_fraction_low"] = masked_mean(lo.float(), r.valid)
        m["icepop_masked_fraction_high"] = masked_mean(hi.float(), r.valid)
    return weight, dropped, m


# ---- sequence rules: each returns None when its config fields are unset --------------------------------------


def seq_mis(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Seq-MIS: weight a sequence by prod_t xi_t, reject it when that is outside [low, high]."""
    if cfg.seq_mis_low is None and cfg.seq_mis_high is None:
        return None
    lo, hi = _outside(r.seq_log_xi, cfg.seq_mis_low, cfg.seq_mis_high)
    rejected = (lo | hi) & r.has_tokens
    metrics = {"seq_mis_rejected_fraction": masked_mean(rejected.float(), r.has_tokens)}
    return Verdict(rejected, metrics, seq_weight=r.seq_log_xi.clamp(-r.clamp, r.clamp).exp())


def seq_tis(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Sequence TIS: weight a sequence by min(prod_t xi_t, cap), reject nothing."""
    if cfg.seq_tis_cap is None:
        return None
    weight = r.seq_log_xi.clamp(-r.clamp, r.clamp).exp().clamp(max=cfg.seq_tis_cap)
    return Verdict(torch.zeros_like(r.has_tokens), {}, seq_weight=weight)


def geo_rs(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Geo-RS: reject a sequence whose geometric-mean xi is outside [low, high]."""
    if cfg.geo_rs_low is None and cfg.geo_rs_high is None:
        return None
    lo, hi = _outside(r.seq_log_xi / r.n_tok.clamp_min(1), cfg.geo_rs_low, cfg.geo_rs_high)
    rejected = (lo | hi) & r.has_tokens
    return Verdict(rejected, {"geo_rs_rejected_fraction": masked_mean(rejected.float(), r.has_tokens)})


def k3_rs(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """K3-RS: reject a sequence whose mean per-token k3 (xi - 1 - log xi) is above the threshold."""
    if cfg.k3_rs_threshold is None:
        return None
    k3_seq = masked_mean(r.xi - 1.0 - r.log_xi, r.valid, dim=1)
    rejected = (k3_seq > cfg.k3_rs_threshold) & r.has_tokens
    return Verdict(rejected, {"k3_rs_rejected_fraction": masked_mean(rejected.float(), r.has_tokens)})


def veto(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Veto: reject a sequence if any token's raw (unclamped) xi is below the threshold."""
    if cfg.veto_threshold is None:
        return None
    catastrophic = r.valid & (r.raw < _log(cfg.veto_threshold))
    vetoed = catastrophic.any(dim=1)
    metrics = {
        "veto_fraction": masked_mean(vetoed.float(), r.has_tokens),
        "catastrophic_token_fraction": masked_mean(catastrophic.float(), r.valid),
    }
    return Verdict(vetoed, metrics)


def outlier_veto(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Two-sided outlier veto (SkyRL's outlier_token_is_threshold_*): reject a sequence if any token's xi is
    below the low threshold or above the high one."""
    if cfg.outlier_token_is_threshold_low is None and cfg.outlier_token_is_threshold_high is None:
        return None
    lo, hi = _outside(r.log_xi, cfg.outlier_token_is_threshold_low, cfg.outlier_token_is_threshold_high)
    under, over = (lo & r.valid).any(dim=1), (hi & r.valid).any(dim=1)
    metrics = {
        "outlier_seq_masked_fraction": masked_mean((under | over).float(), r.has_tokens),
        "outlier_seq_under_low_fraction": masked_mean(under.float(), r.has_tokens),
        "outlier_seq_over_high_fraction": masked_mean(over.float(), r.has_tokens),
    }
    return Verdict(under | over, metrics)


# ---- token rejection rules -----------------------------------------------------------------------------------


def token_rs(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Token rejection: drop a token whose xi is outside [low, high] (its weight still counts in the
    batch-normalisation mean)."""
    if cfg.token_rs_low is None and cfg.token_rs_high is None:
        return None
    lo, hi = _outside(r.log_xi, cfg.token_rs_low, cfg.token_rs_high)
    metrics = {
        "token_rs_masked_fraction_low": masked_mean(lo.float(), r.valid),
        "token_rs_masked_fraction_high": masked_mean(hi.float(), r.valid),
    }
    return Verdict(lo | hi, metrics)


def prefix_rs(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Prefix rejection (SMD's faithful tokens): drop every token of a sequence from the first one whose xi is
    outside [low, high] on, keeping only what the sampler drew before it first diverged from pi_old."""
    if cfg.prefix_rs_low is None and cfg.prefix_rs_high is None:
        return None
    lo, hi = _outside(r.log_xi, cfg.prefix_rs_low, cfg.prefix_rs_high)
    diverged = (lo | hi) & r.valid
    dropped = (diverged.cumsum(dim=1) > 0) & r.valid
    metrics = {
        "prefix_rs_masked_fraction": masked_mean(dropped.float(), r.valid),
        "prefix_rs_cut_fraction": masked_mean(diverged.any(dim=1).float(), r.has_tokens),
    }
    return Verdict(dropped, metrics)


def prob_diff(r: Ratios, cfg: AlgoConfig) -> Verdict | None:
    """Sign-aware probability-difference mask: drop a token of positive advantage whose pi_old - pi_sparse is
    above the threshold, or of negative advantage whose difference is below minus it."""
    if cfg.prob_diff_threshold is None:
        return None
    if r.advantages is None:
        raise ValueError("algo.prob_diff_threshold is set: correction_weights needs `advantages`")
    adv = upcast(r.advantages.detach())
    adv = adv[:, None].expand_as(r.xi) if adv.dim() == 1 else adv
    if adv.shape != r.xi.shape:
        raise ValueError(
            f"advantages have shape {tuple(r.advantages.shape)}, expected [B] or {tuple(r.xi.shape)}"
        )
    diff = r.old.exp() - r.samp.exp()
    t = cfg.prob_diff_threshold
    flagged = r.valid & (((adv > 0) & (diff > t)) | ((adv < 0) & (diff < -t)))
    return Verdict(flagged, {"prob_diff_masked_fraction": masked_mean(flagged.float(), r.valid)})


# A new rule: one function above, its config field(s) in AlgoConfig (and CORRECTION_KNOBS), one entry here.
SEQUENCE_RULES: tuple[Callable[[Ratios, AlgoConfig], Verdict | None], ...] = (
    seq_mis, seq_tis, geo_rs, k3_rs, veto, outlier_veto
)  # fmt: skip
TOKEN_RULES: tuple[Callable[[Ratios, AlgoConfig], Verdict | None], ...] = (token_rs, prefix_rs, prob_diff)


def apply_rules(r: Ratios, cfg: AlgoConfig, m: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Weights (normalised, zero off the keep mask), keep mask and batch-normalisation factor under every rule
    `cfg` sets; each rule's metrics go into `m`."""
    weight, dropped, tm = token_is_weights(r, cfg)
    keep = r.valid & ~dropped
    m.update(tm)
    seq_keep = torch.ones_like(r.has_tokens)
    for rule in SEQUENCE_RULES:
        if (v := rule(r, cfg)) is not None:
            seq_keep &= ~v.drop
            weight = weight if v.seq_weight is None else weight * v.seq_weight[:, None]
            m.update(v.metrics)
    for rule in TOKEN_RULES:
        if (v := rule(r, cfg)) is not None:
            keep &= ~v.drop
            m.update(v.metrics)
    keep &= seq_keep[:, None]
    factor = torch.ones((), dtype=weight.dtype, device=weight.device)
    if cfg.tis_batch_norm:
        mean_w = masked_mean(weight, r.valid)
        if bool(mean_w > cfg.batch_norm_min):
            factor = mean_w
    return masked_fill_safe(weight / factor, keep), keep, factor


def correction_weights(
    logp_old: Tensor,
    logp_sampler: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    advantages: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Importance weights, keep mask and mismatch metrics for one batch of sparse rollouts.

    Args:
        logp_old: [B, T] log pi_old of the sampled tokens from a dense teacher-forced pass (decoupled mode);
            in bypass mode the learner's own log-probs, detached (see `correction_reference`).
        logp_sampler: [B, T] log pi_sparse recorded while sampling, from the distribution sampled from.
        mask: [B, T] response mask (1 = a generated token that may be trained on; 0 = prompt or padding).
            Values at masked positions are ignored, even inf/NaN.
        cfg: the rules to apply; with correction_mode 'none' nothing is reweighted or rejected.
        advantages: [B] or [B, T]; needed only by the sign-aware probability-difference mask.

    Returns:
        weights: [B, T] float32 (float64 for float64 inputs), detached, >= 0, zero wherever keep_mask is 0.
            The truncated / masked IS weight (token TIS, IcePop, Seq-MIS), batch-normalised if asked: divided
            by the mean of the pre-rejection weights over the tokens of `mask` (as the reference does; skipped
            when that mean is <= cfg.batch_norm_min). Normalisation is over the batch passed in: call it on
            the (micro-)batch the reference normalises over.
        keep_mask: [B, T] bool, `mask` minus rejected tokens (token RS, prefix RS, IcePop, prob-diff) and minus
            every token of a rejected sequence (veto, outlier veto, Seq-MIS, Geo-RS, K3-RS). It lies inside
            `mask`, so it *is* the loss mask of `policy_loss` (response mask times keep mask).
        metrics: floats keyed 'rollout_corr/<name>', names as in docs/metrics.md.
    """
    r = log_ratios(logp_old, logp_sampler, mask, cfg.log_ratio_clamp, advantages)
    m = mismatch_metrics(r)
    if cfg.correction_mode == "none":
        weight, keep = r.valid.to(r.xi.dtype), r.valid.clone()
        factor = torch.ones((), dtype=r.xi.dtype, device=r.xi.device)
    else:
        weight, keep, factor = apply_rules(r, cfg, m)
    kept_seqs = keep.any(dim=1)
    m["batch_norm_factor"] = factor
    m["seq_rejection_rate"] = masked_mean((~kept_seqs).float(), r.has_tokens)
    m["token_keep_fraction"] = masked_mean(keep.float(), r.valid, empty=0.0)
    m["weight_mean"] = masked_mean(weight, keep, empty=0.0)
    m["weight_std"] = _std(weight, keep)
    m["weight_min"] = masked_min(weight, keep, empty=0.0)
    m["weight_max"] = masked_max(weight, keep, empty=0.0)
    m["weight_ess"] = _ess(weight, keep)
    return weight.detach(), keep, {PREFIX + k: v for k, v in to_floats(m).items()}


def _std(x: Tensor, mask: Tensor) -> Tensor:
    """Population standard deviation sqrt(mean((x - mean x)^2)) over `mask`; 0 if empty."""
    return masked_mean((x - masked_mean(x, mask)).square(), mask).sqrt()


def _ess(w: Tensor, mask: Tensor) -> Tensor:
    """Normalised effective sample size 1 / mean((w / mean w)^2) over `mask`, in (0, 1]; 1 if empty."""
    mean = masked_mean(w, mask)
    if not bool(mask.any()) or not bool(mean > 0):
        return torch.ones((), dtype=w.dtype, device=w.device)
    return 1.0 / masked_mean((w / mean) ** 2, mask)


def mismatch_metrics(r: Ratios) -> dict[str, Tensor]:
    """The field's mismatch diagnostics, all on raw (pre-truncation, pre-rejection) ratios.

    A sampled token that pi_old gives no mass makes kl and log_xi_min infinite: honest, not hidden.
    """
    old, samp, raw, log_xi, xi, valid, has_tokens, c = (
        r.old, r.samp, r.raw, r.log_xi, r.xi, r.valid, r.has_tokens, r.clamp
    )  # fmt: skip
    m: dict[str, Tensor] = {}
    m["kl"] = masked_mean(-raw, valid)  # mean(log pi_sparse - log pi_old)
    m["k3_kl"] = masked_mean(xi - 1.0 - log_xi, valid)
    seq_lp_old = masked_mean(old, valid, dim=1)
    seq_lp_samp = masked_mean(samp, valid, dim=1)
    log_ppl_diff = seq_lp_samp - seq_lp_old  # = log(training_ppl / rollout_ppl) per sequence
    m["training_ppl"] = masked_mean((-seq_lp_old).clamp(max=c).exp(), has_tokens, empty=1.0)
    m["rollout_ppl"] = masked_mean((-seq_lp_samp).clamp(max=c).exp(), has_tokens, empty=1.0)
    m["training_log_ppl"] = masked_mean(-seq_lp_old, has_tokens)
    m["rollout_log_ppl"] = masked_mean(-seq_lp_samp, has_tokens)
    m["ppl_ratio"] = masked_mean(log_ppl_diff.clamp(-c, c).exp(), has_tokens, empty=1.0)
    m["log_ppl_diff"] = masked_mean(log_ppl_diff, has_tokens)
    m["log_ppl_abs_diff"] = masked_mean(log_ppl_diff.abs(), has_tokens)
    m["chi2_token"] = masked_mean(xi.double() ** 2, valid, empty=1.0) - 1.0
    sum_log = masked_sum(raw, valid, dim=1).clamp(-c, c)
    m["chi2_seq"] = masked_mean((2.0 * sum_log.double()).exp(), has_tokens, empty=1.0) - 1.0
    m["ess"] = _ess(xi.double(), valid)
    m["xi_mean"] = masked_mean(xi, valid, empty=1.0)
    m["xi_std"] = _std(xi, valid)
    m["xi_min"] = masked_min(xi, valid, empty=1.0)
    m["xi_max"] = masked_max(xi, valid, empty=1.0)
    m["log_xi_min"] = masked_min(raw, valid, empty=0.0)
    m["log_xi_max"] = masked_max(raw, valid, empty=0.0)
    m["response_tokens"] = valid.sum().float()
    m["gen_kl_error"] = m["k3_kl"]  # NeMo-RL's name (k3 of log xi, its default kl_type)
    m.update(backend_mismatch(old, samp, log_xi, valid))
    return m
