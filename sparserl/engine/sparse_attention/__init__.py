"""Block-sparse attention: the cache stays whole and each decode step reads only some pages of it. A page
selector is one small class in SELECTORS (`@SELECTORS.register("name")`, selected by kv.method=name)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparserl.engine.sparse_attention.base import SELECTORS, PageSelector, PageSparseAttention
from sparserl.engine.sparse_attention.block_topk import BlockTopK

if TYPE_CHECKING:  # kv_config imports this package for the selector names
    from sparserl.engine.kv_config import KVConfig


def make_sparse_attention(cfg: KVConfig, num_layers: int) -> PageSparseAttention:
    """The page reader for `cfg.method` (a sparse-attention method)."""
    return PageSparseAttention(SELECTORS.lookup(cfg.method)(), cfg, num_layers)


__all__ = ["SELECTORS", "BlockTopK", "PageSelector", "PageSparseAttention", "make_sparse_attention"]
