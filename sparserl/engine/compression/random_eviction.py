"""Random eviction: the control that any scoring rule must beat."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparserl.engine.compression.base import EVICTION_METHODS, EvictionMethod, SlotView

if TYPE_CHECKING:
    from sparserl.engine.kv_config import KVConfig


@EVICTION_METHODS.register("random")
class RandomEviction(EvictionMethod):
    """Uniformly random scores, drawn from a generator seeded by `kv.seed` and the `generate` seed, so that a
    rollout is reproducible whatever ran before it."""

    def __init__(self, cfg: KVConfig):
        super().__init__(cfg)
        self.generator = torch.Generator()
        self.start(0)

    def start(self, seed: int) -> None:
        self.generator.manual_seed(self.cfg.seed * 1_000_003 + seed)

    def score(self, view: SlotView) -> Tensor:
        return torch.rand(view.positions.shape, generator=self.generator).to(view.keys.device)
