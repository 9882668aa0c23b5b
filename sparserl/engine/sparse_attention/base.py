"""The block-sparse attention interface: a `PageSelector` summarises full pages and scores them for a query;
`PageSparseAttention` keeps the summaries, picks the pages each KV head reads at a decode step (the first page,
the 2 most recent, the best-scored others up to the sequence's budget) and gathers them for `decode_attention`.

The cache is never cut, so page p holds positions [p * page_size, (p + 1) * page_size) in every row: a row's
slot is its position, less the whole pages of a shared prefix it reads first (`SharedPrefixCache` with `align` =
the page size), whose summaries are kept once with the prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparserl.engine.cache import KVCache
from sparserl.engine.shared_prefix import SharedPrefixCache
from sparserl.errors import UserError
from sparserl.registry import Registry

if TYPE_CHECKING:  # kv_config validates kv.method against SELECTORS: it imports this module
    from sparserl.engine.kv_config import KVConfig

ALWAYS_READ_PAGES = 3  # block-sparse attention reads the first page and the 2 most recent pages at every step


class PageSelector(ABC):
    """One page-selection rule: what a full page is summarised by, and how a query scores the summaries."""

    @abstractmethod
    def summarise(self, page_keys: Tensor) -> Tensor:
        """Keys of full pages [..., page_size, D] -> their summaries [..., S, D] (S vectors per page)."""

    @abstractmethod
    def score(self, queries: Tensor, summaries: Tensor) -> Tensor:
        """queries [rows, Hkv, G, D] (the G query heads of each KV head), summaries [rows, Hkv, P, S, D] ->
        scores [rows, Hkv, P], higher = read."""


SELECTORS: Registry[type[PageSelector]] = Registry("kv.method")


@dataclass
class StepPlan:
    """What every sparse layer of one decode step reads, per row (decided once per step).

    tokens: positions once the step's token is written; pages: the pages they fill, the partial current one
    included; budget_pages: the budget in pages; read: positions a sparse layer reads; width: the most pages any
    row reads (0 when every row's budget covers all its pages: dense); filled: rows whose token completes a page;
    best: pages chosen by score besides the always-read ones (most_best: the largest of them).
    """

    tokens: Tensor
    pages: Tensor
    budget_pages: Tensor
    read: Tensor
    width: int
    filled: Tensor
    best: Tensor
    most_best: int

    @classmethod
    def make(cls, tokens: Tensor, budget: Tensor, page_size: int) -> StepPlan:
        """The plan for rows of `tokens` positions [rows] under budgets [rows] (in positions)."""
        pages = (tokens + page_size - 1) // page_size
        budget_pages = budget // page_size
        sparse = pages > budget_pages
        width = int(torch.minimum(pages, budget_pages).max()) if bool(sparse.any()) else 0
        # a row over budget skips (pages - budget_pages) full pages; the current page is read whole-so-far
        read = torch.where(sparse, tokens - (pages - budget_pages) * page_size, tokens)
        filled = (tokens % page_size == 0).nonzero().squeeze(-1)
        best = budget_pages - ALWAYS_READ_PAGES
        return cls(tokens, pages, budget_pages, read, width, filled, best, int(best.max()) if width else 0)


def summary_key(layer: int) -> str:
    return f"page_summaries.{layer}"


class PageSparseAttention:
    """Reads, per decode step, layer and KV head, only some pages of a whole cache, with one `PageSelector`.

    Prefill is dense; the layers in `kv.dense_layers` and the rows whose budget covers all their pages read every
    held position through the plain mask, so a covering budget is the dense engine bit for bit.
    """

    def __init__(self, selector: PageSelector, cfg: KVConfig, num_layers: int):
        beyond = [layer for layer in cfg.dense_layers if layer >= num_layers]
        if beyond:
            raise UserError(
                f"kv.dense_layers={cfg.dense_layers} names layer {beyond[0]}, but the model has {num_layers} "
                f"layers (0..{num_layers - 1})"
            )
        self.selector = selector
        self.page_size = cfg.page_size
        self.sparse_layers = [layer for layer in range(num_layers) if layer not in cfg.dense_layers]
        self.plan: StepPlan | None = None

    def start(self, cache: KVCache) -> None:
        """After prefill: summarise every full page of the prompts; the summaries travel with their rows."""
        ps = self.page_size
        rows, hkv, capacity, d = cache.k[0].shape
        # whole pages of the longest prompt; a shorter row's pages past its prompt are summarised again when they fill
        whole = int(cache.length.max()) // ps
        for layer in self.sparse_layers:
            summaries = self.selector.summarise(
                cache.view(layer, whole * ps)[0].reshape(rows, hkv, whole, ps, d)
            )
            store = summaries.new_zeros(rows, hkv, -(-capacity // ps), *summaries.shape[3:])
            cache.paged_state[summary_key(layer)] = ps
            store[:, :, :whole] = summaries
            cache.row_state[summary_key(layer)] = store

    @torch.compiler.disable
    def begin_step(self, tokens: Tensor, budget: Tensor) -> None:
        """Plan a decode step for rows holding `tokens` positions once its token is written, under `budget`.
        Eager even inside a compiled step (its sizes are Python numbers read from the data)."""
        self.plan = StepPlan.make(tokens, budget, self.page_size)

    @torch.compiler.disable
    def attend(
        self, cache: KVCache, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]:
        """`read`, then the cache's attention over what was read: one eager island inside a compiled decode step
        (how many pages a step reads, and which fill, are data-dependent shapes), so that the projections, norms
        and MLP around it still compile with static shapes; the output [rows, Hq, 1, D] has a static shape."""
        if isinstance(cache, SharedPrefixCache) and cache.groups and layer in self.sparse_layers:
            return self._attend_shared(cache, layer, q, k, v, valid, scale)
        k, v, mask = self.read(cache, layer, q, k, v, valid)
        return cache.attention(layer, q, k, v, mask, scale)

    def read(
        self, cache: KVCache, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The keys, values [rows, Hkv, R, D] and mask [rows, (Hkv,) R] that one layer's queries q [rows, Hq, 1,
        D] attend to, given the held slots k, v [rows, Hkv, span, D] and their mask `valid` [rows, span] (the
        step's token already written). Dense layers and dense steps get k, v and valid back untouched."""
        plan = self.plan
        if layer not in self.sparse_layers:
            return k, v, valid
        if plan.filled.numel():
            self._summarise_filled(cache, layer, plan, None)
        if plan.width == 0:
            return k, v, valid
        ps, span = self.page_size, k.shape[2]
        pages = self.select_pages(cache.row_state[summary_key(layer)], q, plan)  # [rows, Hkv, width]
        slots = (pages[..., None] * ps + torch.arange(ps, device=k.device)).flatten(2)
        mask = (pages >= 0).repeat_interleave(ps, dim=-1) & (slots < plan.tokens[:, None, None])
        slots = slots.clamp(0, span - 1)
        return *cache.gather(layer, slots), mask

    def _attend_shared(
        self,
        cache: SharedPrefixCache,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        valid: Tensor,
        scale: float,
    ) -> tuple[Tensor, Tensor]:
        """`attend` for rows that read a shared prefix (its whole pages) before their own slots: the pages are
        chosen among [prefix pages ++ own pages] by the same rule; the own pages are gathered from the row, and
        the prefix's through the cache's shared attention with the pages not chosen masked out (a group's queries
        against the whole prefix in one product: on a CPU cheaper than gathering the pages row by row)."""
        plan, ps = self.plan, self.page_size
        offset = cache.prefix_lengths()
        if plan.filled.numel():
            self._summarise_filled(cache, layer, plan, offset)
        if plan.width == 0:
            return cache.attention(layer, q, k, v, valid, scale)
        scores = self._shared_scores(cache, layer, q, plan, offset)
        pages = self.rank_pages(scores, plan)  # -1 pads at the end
        first_own = (offset // ps)[:, None, None]
        prefix_pages = int(offset.max()) // ps  # the longest held prefix, in pages (prefixes are whole pages)
        chosen = torch.zeros(*pages.shape[:2], prefix_pages + 1, dtype=torch.bool, device=pages.device)
        chosen.scatter_(2, torch.where((pages >= 0) & (pages < first_own), pages, prefix_pages), True)
        # [rows, Hkv, prefix positions]: the held prefix's positions each KV head reads
        prefix_read = chosen[..., :prefix_pages].repeat_interleave(ps, dim=-1)
        past = int(plan.pages.max())  # sorts after every own page: marks the prefix's and the padding
        own = torch.where(pages >= first_own, pages - first_own, past).sort(dim=-1).values
        own = own[..., : int((own < past).sum(-1).max())]  # the most own pages a row reads
        slots = (own[..., None] * ps + torch.arange(ps, device=k.device)).flatten(2)
        own_tokens = (plan.tokens - offset)[:, None, None]
        mask = (own < past).repeat_interleave(ps, dim=-1) & (slots < own_tokens)
        slots = slots.clamp(0, k.shape[2] - 1)
        read_k, read_v = cache.gather(layer, slots)
        return cache.attention(layer, q, read_k, read_v, mask, scale, prefix_read=prefix_read)

    def select_pages(self, summaries: Tensor, q: Tensor, plan: StepPlan) -> Tensor:
        """`rank_pages` of the scores of a whole cache's page summaries [rows, Hkv, pages, S, D]."""
        rows, hkv = summaries.shape[:2]
        n_pages = int(plan.pages.max())
        scores = self.selector.score(q.reshape(rows, hkv, -1, q.shape[-1]), summaries[:, :, :n_pages])
        return self.rank_pages(scores.float(), plan)

    def _shared_scores(
        self, cache: SharedPrefixCache, layer: int, q: Tensor, plan: StepPlan, offset: Tensor
    ) -> Tensor:
        """Scores [rows, Hkv, pages] of every page of rows that read a shared prefix first: its pages scored
        against the summaries kept once with the prefix (one call per prefix), the row's own from its own."""
        ps, key = self.page_size, summary_key(layer)
        own = cache.row_state[key]
        rows, hkv = own.shape[:2]
        queries = q.reshape(rows, hkv, -1, q.shape[-1])
        first_own = offset // ps  # the page a row's own slots start at
        n_pages, n_own = int(plan.pages.max()), max(int((plan.pages - first_own).max()), 1)
        own_scores = self.selector.score(queries, own[:, :, :n_own]).float()  # [rows, Hkv, n_own]
        index = (torch.arange(n_pages, device=q.device) - first_own[:, None]).clamp(0, n_own - 1)
        scores = own_scores.gather(2, index[:, None].expand(-1, hkv, -1))
        for prefix, members in cache.groups:
            summaries = prefix.paged[key]  # [Hkv, prefix pages, S, D]
            if summaries.shape[1]:
                expanded = summaries[None].expand(members.numel(), *summaries.shape)
                part = self.selector.score(queries[members], expanded).float()
                scores[members, :, : summaries.shape[1]] = part
        return scores

    def rank_pages(self, scores: Tensor, plan: StepPlan) -> Tensor:
        """Page indices [rows, Hkv, plan.width] each KV head reads, in order (-1 pads a row that reads fewer),
        given every page's score [rows, Hkv, pages]: page 0, the current page and the one before it, and the
        best-scored of the other (full) pages, as many as the row's budget leaves. Ties go to the older page."""
        hkv, n_pages = scores.shape[1:]
        last = plan.pages - 1  # the current page, being written
        page = torch.arange(n_pages, device=scores.device)
        candidate = (page > 0) & (page < (last - 1)[:, None])  # [rows, n_pages]
        # a stable sort: equal scores rank the older page first, whatever else is in the batch
        ranked = scores.masked_fill(~candidate[:, None], float("-inf")).sort(
            dim=-1, descending=True, stable=True
        )
        n_best = min(plan.most_best, n_pages)
        rank = torch.arange(n_best, device=scores.device)
        best_ok = (rank < plan.best[:, None, None]) & (ranked.values[..., :n_best] > float("-inf"))
        always = torch.stack([torch.zeros_like(last), last - 1, last], dim=-1)  # [rows, 3]
        always_ok = torch.stack([torch.ones_like(last, dtype=torch.bool), last > 1, last > 0], dim=-1)
        pages = torch.cat([always[:, None].expand(-1, hkv, -1), ranked.indices[..., :n_best]], dim=-1)
        ok = torch.cat([always_ok[:, None].expand(-1, hkv, -1), best_ok], dim=-1)
        picked = torch.where(ok, pages, n_pages).sort(dim=-1).values[..., : plan.width]
        return torch.where(picked < n_pages, picked, -1)

    def _summarise_filled(self, cache: KVCache, layer: int, plan: StepPlan, offset: Tensor | None) -> None:
        """Summarise the page that this step's token completed, in the rows where it did (`offset`: positions
        of a shared prefix before a row's own slots)."""
        ps, rows = self.page_size, plan.filled
        first = plan.tokens[rows] - ps  # first slot of the completed page
        if offset is not None:
            first = first - offset[rows]
        slots = first[:, None] + torch.arange(ps, device=rows.device)  # [f, ps]
        keys = cache.slot_keys(layer, rows, slots)  # [f, Hkv, ps, D]
        cache.row_state[summary_key(layer)][rows, :, first // ps] = self.selector.summarise(keys)
