"""Block-sparse attention: the cache stays whole and each decode step reads only some pages of it."""

from __future__ import annotations

from sparserl.engine.kv_config import KVConfig
from sparserl.engine.sparse_attention.base import PageSelector, PageSparseAttention
from sparserl.engine.sparse_attention.block_topk import BlockTopK

SELECTORS: dict[str, type[PageSelector]] = {"block_topk": BlockTopK}  # one per SPARSE_ATTENTION_METHODS


def make_sparse_attention(cfg: KVConfig, num_layers: int) -> PageSparseAttention:
    """The page reader for `cfg.method` (a sparse-attention method)."""
    return PageSparseAttention(SELECTORS[cfg.method](), cfg, num_layers)


__all__ = ["SELECTORS", "BlockTopK", "PageSelector", "PageSparseAttention", "make_sparse_attention"]
