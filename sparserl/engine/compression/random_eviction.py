"""Random eviction: the control that any scoring rule must beat."""

from __future__ import annotations

import torch
from torch import Tensor

from sparserl.engine.compression.base import EvictionMethod, SlotView
from sparserl.engine.kv_config import KVConfig


class RandomEviction(EvictionMethod):
    def __init__(self, cfg: KVConfig):
        super().__init__(cfg)
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def score(self, view: SlotView) -> Tensor:
        return torch.rand(view.positions.shape, generator=self.generator).to(view.keys.device)
