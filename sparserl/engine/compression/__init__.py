"""KV eviction methods, one small class each, and the `Evictor` that applies them."""

from __future__ import annotations

from sparserl.engine.compression.base import EvictionMethod, Evictor, SlotView
from sparserl.engine.compression.h2o import H2O
from sparserl.engine.compression.random_eviction import RandomEviction
from sparserl.engine.compression.rkv import RKV
from sparserl.engine.compression.snapkv import SnapKV
from sparserl.engine.compression.streaming_llm import StreamingLLM
from sparserl.engine.kv_config import KVConfig

METHODS: dict[str, type[EvictionMethod]] = {
    "rkv": RKV,
    "snapkv": SnapKV,
    "h2o": H2O,
    "streaming_llm": StreamingLLM,
    "random": RandomEviction,
}


def make_evictor(cfg: KVConfig, scale: float) -> Evictor:
    """The evictor for `cfg.method` (an eviction method; `dense` has none)."""
    return Evictor(METHODS[cfg.method](cfg), cfg, scale)


__all__ = ["METHODS", "EvictionMethod", "Evictor", "SlotView", "make_evictor"]
