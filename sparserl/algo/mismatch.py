"""Training-inference mismatch diagnostics that other projects log under their own names (docs/metrics.md):
verl's Pearson correlation of the two sides' token probabilities, NeMo-RL's multiplicative probability error
and its KL and Jensen-Shannon estimates. All are taken on the sampled tokens of the valid positions, before any
correction; NeMo-RL's are written in the clamped log-ratio d_t = log xi_t = log pi_old - log pi_sparse alone."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sparserl.algo.masked import masked_mean


def pearson_corr(p: Tensor, q: Tensor, valid: Tensor) -> Tensor:
    """Pearson's r between `p` and `q` pooled over the `valid` positions (verl correlates the two sides'
    probabilities, exp of the log-probs). Where r is undefined (fewer than two positions, or a side constant;
    verl logs NaN) it is 1.0 if the two sides are equal everywhere, else 0.0: never NaN."""
    x, y = p[valid].double(), q[valid].double()
    xc, yc = x - x.mean(), y - y.mean()
    den = (xc.square().sum() * yc.square().sum()).sqrt()
    if not bool(den > 0):
        return torch.tensor(float(torch.equal(x, y)), dtype=torch.float64)
    return (xc * yc).sum() / den


def js_token(d: Tensor) -> Tensor:
    """NeMo-RL's per-token Jensen-Shannon term on the drawn token: with m = (p_old + p_sparse) / 2 and
    k3(r) = r - 1 - log r, 0.5 k3(p_old / m) + 0.5 k3(p_sparse / m), written in d = log(p_old / p_sparse)."""
    log_mix = torch.logaddexp(d, torch.zeros_like(d)) - math.log(2.0)  # log(m / p_sparse)
    a, b = d - log_mix, -log_mix  # log(p_old / m), log(p_sparse / m)
    return 0.5 * (torch.expm1(a) - a) + 0.5 * (torch.expm1(b) - b)


def backend_mismatch(old: Tensor, samp: Tensor, log_xi: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """verl's `pearson_corr` and NeMo-RL's `token_mult_prob_error`, `policy_kl_error`, `js_divergence_error`
    over the valid tokens (NeMo-RL's `gen_kl_error` is `k3_kl`, which the caller already has)."""
    return {
        "pearson_corr": pearson_corr(old.exp(), samp.exp(), valid),
        "token_mult_prob_error": masked_mean(log_xi.abs().exp(), valid, empty=1.0),
        "policy_kl_error": masked_mean(torch.expm1(-log_xi) + log_xi, valid),
        "js_divergence_error": masked_mean(js_token(log_xi), valid),
    }
