"""StreamingLLM: keep the first `n_sink` positions (attention sinks) and the most recent ones."""

from __future__ import annotations

from torch import Tensor

from sparserl.engine.compression.base import EVICTION_METHODS, EvictionMethod, SlotView


@EVICTION_METHODS.register("streaming_llm")
class StreamingLLM(EvictionMethod):
    keeps_sinks = True

    def score(self, view: SlotView) -> Tensor:
        pos = view.positions.float()
        return pos + (view.positions < self.cfg.n_sink).float() * 1e12
