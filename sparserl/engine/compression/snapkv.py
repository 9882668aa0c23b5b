"""SnapKV: keep the slots the last `window` queries attend to most, smoothed by max-pooling."""

from __future__ import annotations

from torch import Tensor

from sparserl.engine.compression.base import (
    EVICTION_METHODS,
    EvictionMethod,
    SlotView,
    max_pool,
    window_attention,
)


@EVICTION_METHODS.register("snapkv")
class SnapKV(EvictionMethod):
    def score(self, view: SlotView) -> Tensor:
        return max_pool(window_attention(view), self.cfg.pool_kernel)
