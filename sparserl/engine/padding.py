"""Right padding: rows of different lengths into one [B, W] tensor and the mask of their real entries (token
ids for a forward, log-probs and loss masks for the learner)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def right_pad(
    rows: Sequence[Sequence[int] | Sequence[float] | Tensor],
    dtype: torch.dtype = torch.long,
    value: float = 0,
    width: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Values [B, W] of `dtype` (row i in its first len(row) columns, `value` after) and a bool mask [B, W] of
    those columns. W: `width`, else the longest row's length (0 for no rows); a row longer than W is cut."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = min(len(r), width)
        if n:
            out[i, :n] = torch.as_tensor(r, dtype=dtype)[:n]
            mask[i, :n] = True
    return out, mask
