"""The eviction interface: a method scores held slots; `Evictor` keeps the best ones plus the recent window."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparserl.engine.cache import KVCache
from sparserl.registry import Registry

if TYPE_CHECKING:  # kv_config validates kv.method against EVICTION_METHODS: it imports this module
    from sparserl.engine.kv_config import KVConfig


@dataclass
class SlotView:
    """What a method may look at in one layer, for the rows being compressed.

    keys [r, Hkv, S, D]; positions [r, Hkv, S]; held [r, S] marks the slots a row holds (S is the longest row's
    length); candidates [r, S] marks held slots outside the protected recent window (only those compete);
    queries [r, Hq, w, D] are the last queries seen, `num_queries` [r] of them valid; extras are the per-slot
    states the method asked the cache to carry.
    """

    keys: Tensor
    positions: Tensor
    held: Tensor
    candidates: Tensor
    queries: Tensor
    num_queries: Tensor
    extras: dict[str, Tensor]
    scale: float


class EvictionMethod(ABC):
    """One KV eviction rule. Higher score = keep. Subclasses stay small: a score, maybe an observer."""

    extras: tuple[str, ...] = ()
    # True: the first kv.n_sink positions (attention sinks) score above every other candidate, so they are held
    # like the recent window (kv.budget must exceed both)
    keeps_sinks: bool = False

    def __init__(self, cfg: KVConfig):
        self.cfg = cfg

    @abstractmethod
    def score(self, view: SlotView) -> Tensor:
        """Scores [r, Hkv, S] of every slot (non-candidates are ignored)."""

    def start(self, seed: int) -> None:
        """Called at the start of every `generate` call with its seed; stateful methods reset here."""

    def observe(self, cache: KVCache, layer: int, probs: Tensor, span: int) -> None:
        """See one decode step's attention probabilities [rows, Hkv, G, span]; stateless methods ignore it."""

    def observe_prefill(self, cache: KVCache, layer: int, probs: Tensor) -> None:
        """See the prefill attention [rows, Hkv, G, T, T] (only called when `needs_prefill_attention`)."""

    needs_prefill_attention: bool = False


EVICTION_METHODS: Registry[type[EvictionMethod]] = Registry("kv.method")


def window_attention(view: SlotView) -> Tensor:
    """SnapKV's window attention to the candidate keys, in the reference code's order: the max over each KV
    group's query heads of the raw logits q k / sqrt(d), then a softmax over the candidates (window keys
    excluded) per window query, then the mean over the valid window queries. Returns [r, Hkv, S].

    The order is the reference code's (`attn_pooling="max"`); a softmax per query head before the max ranks
    keys differently. Non-candidates get 0 and every score is >= 0, so max-pooling all slots afterwards gives each candidate
    what pooling the candidates alone (the reference) gives.
    """
    r, hkv, s, d = view.keys.shape
    hq, w = view.queries.shape[1], view.queries.shape[2]
    q = view.queries.view(r, hkv, hq // hkv, w, d).float()
    logits = torch.matmul(q, view.keys.float()[:, :, None].transpose(-1, -2)) * view.scale  # [r,Hkv,G,w,S]
    logits = logits.amax(dim=2).masked_fill(~view.candidates[:, None, None, :], float("-inf"))
    probs = logits.softmax(dim=-1).nan_to_num(0.0)  # [r, Hkv, w, S]
    q_valid = (torch.arange(w, device=q.device)[None, :] < view.num_queries[:, None]).float()  # [r, w]
    return (probs * q_valid[:, None, :, None]).sum(2) / q_valid.sum(1).clamp(min=1)[:, None, None]


def max_pool(scores: Tensor, kernel: int) -> Tensor:
    """1-D max pooling along slots with 'same' padding, smoothing scores over neighbouring tokens."""
    r, h, s = scores.shape
    pooled = torch.nn.functional.max_pool1d(
        scores.reshape(r * h, 1, s), kernel, stride=1, padding=kernel // 2
    )
    return pooled.view(r, h, s)


class Evictor:
    """Cuts rows of a cache back to a target number of slots with one eviction method."""

    def __init__(self, method: EvictionMethod, cfg: KVConfig, scale: float):
        self.method = method
        self.cfg = cfg
        self.scale = scale

    def compress(self, cache: KVCache, rows: Tensor, target: int, keep_recent: int) -> None:
        """Keep `target` slots of each listed row in every layer: the last `keep_recent` plus the best-scored."""
        if rows.numel() == 0:
            return
        if rows.numel() == cache.rows:  # every row (the usual case): index by slice, copying nothing
            rows = slice(None)
        slots = [self.select(cache, 0, rows, target, keep_recent)]
        shared = self.cfg.granularity == "shared"  # the first layer's choice in every layer
        for layer in range(1, cache.num_layers):
            slots.append(slots[0] if shared else self.select(cache, layer, rows, target, keep_recent))
        cache.keep_slots(rows, slots)

    def select(
        self, cache: KVCache, layer: int, rows: Tensor | slice, target: int, keep_recent: int
    ) -> Tensor:
        """Slot indices [r, Hkv, target] to keep, in chronological order."""
        keys, positions, extras, length = cache.eviction_slots(layer, rows)
        slot = torch.arange(keys.shape[2], device=keys.device)[None, :]
        recent_start = (length - keep_recent)[:, None]
        view = SlotView(
            keys=keys,
            positions=positions,
            held=slot < length[:, None],
            candidates=slot < recent_start,
            queries=cache.queries[layer][rows],
            num_queries=cache.query_count[rows].clamp(max=cache.queries[layer].shape[2]),
            extras=extras,
            scale=self.scale,
        )
        scores = self.method.score(view).float()
        if self.cfg.granularity == "shared":
            scores = scores.sum(dim=1, keepdim=True).expand_as(scores)
        scores = scores.masked_fill(~view.candidates[:, None, :], float("-inf"))
        # a stable sort breaks ties (max-pooling makes plateaus) towards the older slot, whatever the span, so a
        # sequence keeps the same positions alone or beside longer ones in a batch (topk's tie order varies)
        best = scores.sort(dim=-1, descending=True, stable=True).indices[..., : target - keep_recent]
        recent = (recent_start + torch.arange(keep_recent, device=keys.device)[None, :])[:, None, :]
        recent = recent.expand(-1, keys.shape[1], -1)
        return torch.cat([best, recent], dim=-1).sort(dim=-1).values

    def compress_to(self, cache: KVCache, rows: Tensor, targets: Tensor, keep_recent: int) -> None:
        """Cut each listed row to its own target (its budget under a length schedule): one `compress` per
        distinct target, so a constant budget is one pass as before."""
        for target in targets.unique().tolist():
            self.compress(cache, rows[targets == target], target, keep_recent)
