"""KV eviction methods, one small class each in EVICTION_METHODS (`@EVICTION_METHODS.register("name")`, selected
by kv.method=name), and the `Evictor` that applies them."""

from __future__ import annotations

from typing import TYPE_CHECKING

# each import registers its method; this order is kv.method's listing
# isort: off
from sparserl.engine.compression import rkv, snapkv, h2o, streaming_llm, random_eviction  # noqa: F401

# isort: on
from sparserl.engine.compression.base import EVICTION_METHODS, EvictionMethod, Evictor, SlotView

if TYPE_CHECKING:  # kv_config imports this package for the method names
    from sparserl.engine.kv_config import KVConfig


def make_evictor(cfg: KVConfig, scale: float) -> Evictor:
    """The evictor for `cfg.method` (an eviction method; `dense` has none)."""
    return Evictor(EVICTION_METHODS.lookup(cfg.method)(cfg), cfg, scale)


__all__ = ["EVICTION_METHODS", "EvictionMethod", "Evictor", "SlotView", "make_evictor"]
