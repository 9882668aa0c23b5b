"""Token masks that are not importance-ratio corrections, one small function each, selected by its config key.

- `truncated_completion_mask` (TRL's mask_truncated_completions): a loss mask; a completion cut at its length
  cap leaves every term and every denominator.
- PG_MASKS act on the policy-gradient term alone (`policy_loss` multiplies it by their product; the KL and
  entropy terms and the denominators keep every loss-mask token), as their papers write them:
  `off_policy_mask` (DeepSeek-V3.2's off-policy sequence masking, M_i,t in its GRPO objective) and
  `top_entropy_mask` (TRL's top_entropy_quantile, "Beyond the 80/20 rule").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparserl.algo.masked import masked_fill_safe, masked_mean, upcast

if TYPE_CHECKING:  # annotations only
    from sparserl.algo.config import AlgoConfig


def truncated_completion_mask(mask: Tensor, truncated: Tensor | None, cfg: AlgoConfig) -> Tensor:
    """`mask` [B, T] without the rows of the completions that hit their length cap (`truncated` [B] bool) when
    cfg.mask_truncated_completions; unchanged otherwise."""
    if not cfg.mask_truncated_completions:
        return mask
    if truncated is None:
        raise ValueError(
            "algo.mask_truncated_completions=true needs to know which completions hit their length cap "
            "(Batch.truncated, from each sample's finish reason 'length')"
        )
    return mask & ~truncated.bool()[:, None]


@dataclass(frozen=True)
class PgInputs:
    """What a policy-gradient mask reads, [B, T]: log pi_theta (upcast, zero off the mask), advantages, the bool
    loss mask, and, where the caller has them, the learner's token entropies and the sampler's log-probs."""

    lp: Tensor
    adv: Tensor
    m: Tensor
    entropy: Tensor | None = None
    logp_sampler: Tensor | None = None


def off_policy_mask(x: PgInputs, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]] | None:
    """DeepSeek-V3.2: drop the policy term where A < 0 and the sequence's mean over the loss mask of
    log(pi_sampler / pi_theta), the KL from the sampler to the learner, exceeds delta."""
    if cfg.off_policy_mask_threshold is None:
        return None
    if x.logp_sampler is None:
        raise ValueError("algo.off_policy_mask_threshold is set: policy_loss needs logp_sampler")
    samp = masked_fill_safe(upcast(x.logp_sampler.detach()), x.m)
    seq_kl = masked_mean(samp - x.lp.detach(), x.m, dim=1)
    drop = x.m & (x.adv < 0) & (seq_kl > cfg.off_policy_mask_threshold)[:, None]
    return ~drop, {"off_policy_masked_fraction": masked_mean(drop.float(), x.m)}


def top_entropy_mask(x: PgInputs, cfg: AlgoConfig) -> tuple[Tensor, dict[str, Tensor]] | None:
    """TRL: keep the policy term only where the token's entropy is >= the (1 - top_entropy_quantile) quantile
    (linear interpolation, torch.quantile's) of the entropies over the loss mask."""
    if cfg.top_entropy_quantile >= 1.0:
        return None
    if x.entropy is None:
        raise ValueError(
            f"algo.top_entropy_quantile={cfg.top_entropy_quantile} < 1 needs the per-token entropy"
        )
    ent = x.entropy.detach().double()
    if not bool(x.m.any()):
        return torch.ones_like(x.m), {"entropy_masked_fraction": torch.zeros((), dtype=ent.dtype)}
    drop = x.m & (ent < torch.quantile(ent[x.m], 1.0 - cfg.top_entropy_quantile))
    return ~drop, {"entropy_masked_fraction": masked_mean(drop.float(), x.m)}


PG_MASKS: tuple[Callable[[PgInputs, AlgoConfig], tuple[Tensor, dict[str, Tensor]] | None], ...] = (
    off_policy_mask,
    top_entropy_mask,
)


def pg_keep(x: PgInputs, cfg: AlgoConfig) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Where the policy term stays under every mask `cfg` sets (None: all of it), and their metrics."""
    keep: Tensor | None = None
    metrics: dict[str, Tensor] = {}
    for rule in PG_MASKS:
        if (v := rule(x, cfg)) is not None:
            keep = v[0] if keep is None else keep & v[0]
            metrics.update(v[1])
    return keep, metrics
