"""Sparrow's page selector: a page is summarised by the centroid of its keys and scored by q_bar . centroid."""

from __future__ import annotations

from torch import Tensor

from sparserl.engine.sparse_attention.base import SELECTORS, PageSelector


@SELECTORS.register("block_topk")
class BlockTopK(PageSelector):
    """q_bar is the mean of the KV group's query heads, so one score per KV head and page (spec section 1)."""

    def summarise(self, page_keys: Tensor) -> Tensor:
        return page_keys.float().mean(dim=-2, keepdim=True)

    def score(self, queries: Tensor, summaries: Tensor) -> Tensor:
        q_bar = queries.float().mean(dim=2)  # [rows, Hkv, D]
        return (summaries[..., 0, :] @ q_bar[..., None])[..., 0]
