"""Masked reductions and input checks shared by corrections and loss (padding never leaks into a value)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def as_mask(mask: Tensor, like: Tensor, name: str = "mask") -> Tensor:
    """`mask` as a bool tensor of `like`'s shape; raises naming `name` when shapes differ."""
    if mask.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    return mask.bool() if mask.dtype != torch.bool else mask


def check_2d(name: str, x: Tensor) -> None:
    """Raise unless `x` is a [B, T] tensor."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be [batch, tokens], got shape {tuple(x.shape)}")


def upcast(x: Tensor) -> Tensor:
    """`x` in at least float32 (bf16/fp16 are promoted; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_fill_safe(x: Tensor, mask: Tensor, value: float = 0.0) -> Tensor:
    """`x` where `mask`, `value` elsewhere; garbage (inf/NaN) at padding gets neither value nor gradient."""
    return torch.where(mask, x, torch.full_like(x, value))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over `mask` (all of it, or along `dim`)."""
    x = masked_fill_safe(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def token_mask(rows: Tensor, lengths: Sequence[int]) -> Tensor:
    """Where `rows` hold a value: all of a per-sequence [B]; each row's first `lengths[i]` of a per-token
    [B, T] (advantages padded past a completion's end)."""
    if rows.dim() == 1:
        return torch.ones_like(rows, dtype=torch.bool)
    return torch.arange(rows.shape[1])[None, :] < torch.as_tensor(list(lengths))[:, None]


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None, empty: float = 0.0) -> Tensor:
    """Mean of `x` over `mask`; `empty` where nothing is selected (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    total = masked_sum(x, mask, dim)
    mean = total / count.clamp_min(1).to(total.dtype)
    return torch.where(count > 0, mean, torch.full_like(mean, empty))


def masked_max(x: Tensor, mask: Tensor, empty: float = 0.0) -> Tensor:
    """Max of `x` over `mask`; `empty` if nothing is selected."""
    if not bool(mask.any()):
        return torch.tensor(empty, dtype=x.dtype, device=x.device)
    return masked_fill_safe(x, mask, float("-inf")).max()


def masked_min(x: Tensor, mask: Tensor, empty: float = 0.0) -> Tensor:
    """Min of `x` over `mask`; `empty` if nothing is selected."""
    if not bool(mask.any()):
        return torch.tensor(empty, dtype=x.dtype, device=x.device)
    return masked_fill_safe(x, mask, float("inf")).min()


def to_floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Turn a dict of scalar tensors into python floats with one device sync."""
    keys = list(metrics)
    tensors = [torch.as_tensor(metrics[k], dtype=torch.float64).detach().reshape(()).cpu() for k in keys]
    values = torch.stack(tensors).tolist() if tensors else []
    return dict(zip(keys, values, strict=True))
