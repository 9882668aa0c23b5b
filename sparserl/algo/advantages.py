"""Group-relative advantages (GRPO, Dr. GRPO, RLOO) from one scalar reward per completion."""

from __future__ import annotations

import torch
from torch import Tensor

from sparserl.algo.config import ADV_ESTIMATORS, AlgoConfig


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_unbiased: bool = True,
) -> Tensor:
    """Per-sequence advantages; the `group_size` completions of one prompt are contiguous in `rewards`.

    - grpo:   (R_i - mean_G R) / (std_G R + eps), std unbiased (n-1) by default.
    - drgrpo: R_i - mean_G R (no std normalisation, Dr. GRPO).
    - rloo:   R_i - mean_{j != i} R_j (leave-one-out baseline).

    Computed over every sequence of the group, before any rejection (rejected samples stay in their group's
    statistics). A group of equal rewards gets zero advantage, never NaN. Returns shape [num_seqs], float32
    (float64 for float64 rewards).
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"advantage estimator {estimator!r} is unknown; choose one of {', '.join(ADV_ESTIMATORS)}"
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_seqs], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards ({rewards.numel()}); "
            "the completions of one prompt must be contiguous"
        )
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().double()  # a handful of numbers: exact group statistics are free
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise ValueError(f"rewards are not finite at sequence index(es) {bad[:10]}")
    if r.numel() == 0:
        return r.to(out_dtype)
    g = r.view(-1, group_size)
    if group_size == 1:
        if estimator == "rloo":
            raise ValueError("the 'rloo' estimator needs group_size >= 2")
        return torch.zeros_like(r, dtype=out_dtype)
    mean = g.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        std = g.std(dim=1, keepdim=True, unbiased=std_unbiased)
        adv = (g - mean) / (std + eps)
    elif estimator == "drgrpo":
        adv = g - mean
    else:  # rloo: baseline is the mean of the other G-1 rewards
        adv = (g - mean) * group_size / (group_size - 1)
    # A group of equal rewards carries no signal: exactly zero (no 0/0 with eps=0, no float residue).
    flat = g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(out_dtype)


def advantages_from_config(rewards: Tensor, cfg: AlgoConfig) -> Tensor:
    """`grpo_advantages` with the estimator, group size, eps and std choice of `cfg`."""
    return grpo_advantages(
        rewards,
        cfg.group_size,
        estimator=cfg.adv_estimator,
        eps=cfg.adv_eps,
        std_unbiased=cfg.adv_std_unbiased,
    )
