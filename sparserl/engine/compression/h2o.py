"""H2O (heavy hitters): keep the slots that have received the most attention so far, per KV head."""

from __future__ import annotations

from torch import Tensor

from sparserl.engine.cache import KVCache
from sparserl.engine.compression.base import EVICTION_METHODS, EvictionMethod, SlotView


@EVICTION_METHODS.register("h2o")
class H2O(EvictionMethod):
    extras = ("attention",)
    needs_prefill_attention = True

    def score(self, view: SlotView) -> Tensor:
        return view.extras["attention"]

    def observe(self, cache: KVCache, layer: int, probs: Tensor, span: int) -> None:
        cache.extras["attention"][layer][:, :, :span] += probs.sum(dim=2)

    def observe_prefill(self, cache: KVCache, layer: int, probs: Tensor) -> None:
        t = probs.shape[-1]
        cache.extras["attention"][layer][:, :, :t] += probs.sum(dim=(2, 3))
