"""DistillSparse v2's loss (tensors in, loss and metrics out): on-policy distillation of the dense policy (the
teacher) into the sparse path (the student: sparse attention + its adapter), on the student's own samples.

Per token t, a full-vocabulary divergence between the two next-token distributions on the same prefix:
- `tv`: total variation, 0.5 sum_v |p_s(v) - p_d(v)| = 1 - alpha_t, the quantity Sparrow's tail is read from;
- `forward_kl`: KL(p_d || p_s) = sum_v p_d(v) (log p_d(v) - log p_s(v)), mass-covering.

Tail weighting puts the update where alpha is low (the tail that P5 reads):
- `none`: every token 1;
- `tv`: w_t proportional to 1 - alpha_t (detached), scaled to mean 1 over the valid tokens;
- `lowest`: per bin of absolute position, the `fraction` of tokens with the lowest alpha get 1 / fraction, the
  others 0 (mean ~1).
No reward or advantage enters: the adapter only learns to sample what the dense policy would.
"""

from __future__ import annotations

import torch
from torch import Tensor

DIVERGENCES = ("tv", "forward_kl")
TAIL_WEIGHTS = ("none", "tv", "lowest")


def token_divergence(student_logp: Tensor, teacher_logp: Tensor, kind: str) -> Tensor:
    """Per-token divergence [...] between the student's and the teacher's next-token log-probs [..., V]
    (gradient flows to the student only; the teacher is a target)."""
    teacher_logp = teacher_logp.detach()
    if kind == "tv":
        return 0.5 * (student_logp.exp() - teacher_logp.exp()).abs().sum(-1)
    if kind == "forward_kl":
        p = teacher_logp.exp()  # ids a top-k/top-p cut gives the teacher 0: 0 x log 0 = 0; the student's -inf
        # (cut) log-probs are floored so a teacher id the student cut costs a large finite penalty
        return (p * (teacher_logp - student_logp.clamp(min=-100.0))).nan_to_num(0.0).sum(-1)
    raise ValueError(f"distill divergence {kind!r} is unknown; choose one of {', '.join(DIVERGENCES)}")


def tail_weights(
    alpha: Tensor, positions: Tensor, mask: Tensor, mode: str, fraction: float = 0.2, bin_width: int = 512
) -> Tensor:
    """Weights [...] of each token (0 where `mask` is 0) from its alpha (1 - TV, detached) and absolute position;
    see the module docstring for the modes."""
    alpha, valid = alpha.detach().float(), mask.bool()
    if mode == "none":
        return valid.float()
    if mode == "tv":
        gap = (1 - alpha).clamp(min=0) * valid
        mean = gap.sum() / valid.sum().clamp(min=1)
        return gap / mean if mean > 0 else valid.float()
    if mode == "lowest":
        if not 0 < fraction <= 1:
            raise ValueError(f"tail fraction {fraction} must be in (0, 1]")
        weights = torch.zeros_like(alpha)
        bins = torch.div(positions, bin_width, rounding_mode="floor")
        for b in torch.unique(bins[valid]):
            cell = valid & (bins == b)
            cutoff = torch.quantile(alpha[cell], fraction)
            weights[cell & (alpha <= cutoff)] = 1 / fraction
        return weights
    raise ValueError(f"distill tail weighting {mode!r} is unknown; choose one of {', '.join(TAIL_WEIGHTS)}")


def distill_loss(
    student_logp: Tensor,
    teacher_logp: Tensor,
    positions: Tensor,
    mask: Tensor,
    divergence: str,
    weighting: str,
    fraction: float = 0.2,
    bin_width: int = 512,
) -> tuple[Tensor, dict[str, float]]:
    """The summed weighted divergence over the valid tokens of [B, T, V] log-probs (the caller divides by the
    mini-batch's token count, as the policy loss does) and its metrics: the mean TV (1 - alpha), the mean
    divergence, the weighted loss per token and the largest weight."""
    divergence_t = token_divergence(student_logp, teacher_logp, divergence)
    with torch.no_grad():
        tv = 0.5 * (student_logp.exp() - teacher_logp.exp()).abs().sum(-1)
    weights = tail_weights(1 - tv, positions, mask, weighting, fraction, bin_width)
    valid = mask.bool()
    tokens = int(valid.sum())
    loss = (weights * divergence_t * valid).sum()
    metrics = {
        "distill/tv": float(tv[valid].mean()) if tokens else 0.0,
        f"distill/{divergence}": float(divergence_t.detach()[valid].mean()) if tokens else 0.0,
        "distill/loss": float(loss.detach()) / max(tokens, 1),
        "distill/weight_max": float(weights.max()) if tokens else 0.0,
    }
    return loss, metrics
