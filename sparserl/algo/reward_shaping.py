"""Reward shaping applied before advantages: pure functions, rewards and lengths in, new rewards out."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, caps: Tensor, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to `cap - buffer` tokens, then falling
    linearly to -penalty at the cap, -penalty beyond it. `lengths`, `caps` [B] (each completion's own cap);
    buffer 0 gives zeros."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.double() - (caps.double() - buffer)).clamp(min=0) / buffer
    return (-penalty * over.clamp(max=1.0)).float()
