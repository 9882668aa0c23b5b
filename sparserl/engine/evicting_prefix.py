"""A group's prompt held once under an evicting cache: each child keeps its own bounded set of slots, part of it
in the shared prompt (a mask per layer and KV head), the rest in its own row.

What it reproduces is the copied prompt: the prompt, cut to its budget once after prefill, copied into each of
the n rows, every row then evicting on its own path (its own queries score the slots). Here the cut prompt is
stored once, and a row's held set is [the prompt slots its mask marks ++ its own slots]: slot for slot and in the
same chronological order the copied row's set, so an eviction method scores the same view and keeps the same
slots (`eviction_slots`), and attention masks the prompt slots a row no longer holds.

After a cut every head of a row keeps the same number of slots (its budget), some in the prompt and some in its
own row, and a row has one length: where a head keeps fewer of its own slots than the row's most, its latest
kept prompt slots are copied into its own row (chronological order holds: prompt slots come before own ones).
So a row never holds more than its budget, and the shared part, held once, is the prompt slots a row still
reads there. The prompt's storage is released when its last reader finishes.

Methods with per-slot state (H2O's accumulated attention) keep copies: that state over the prompt's slots is
each child's own, so it cannot be held once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl.engine.cache import KVCache
from sparserl.engine.compression import EvictionMethod
from sparserl.engine.shared_prefix import PREFIX, HeldPrefix, SharedPrefixCache

HELD = "prefix_held"  # row_state [rows, layers, Hkv, width]: the slots of its prefix a row still holds


@dataclass
class PrefixWindow:
    """What an evicting row needs of its cut prompt beside the keys and values: their true positions per layer
    [Hkv, L] (a cut keeps different positions per head) and the prompt's last queries per layer [Hq, w, D] (the
    window that scores slots at the first cut)."""

    pos: list[Tensor]
    queries: list[Tensor]
    query_count: int


@dataclass
class EvictingHeldPrefix(HeldPrefix):
    """What an evicting row reads held once: the prefix, its window, and the slots of it the row still held
    [layers, Hkv, L]."""

    window: PrefixWindow
    held: Tensor


class EvictingPrefixCache(SharedPrefixCache):
    """A `SharedPrefixCache` whose readers evict: `width` is the longest prefix it may hold (the largest budget,
    or the longest input if shorter: a prompt is cut to its budget before it is held)."""

    reading_state = (PREFIX, HELD)

    def __init__(self, *args, width: int, **kwargs):
        if kwargs.get("extras"):
            raise ValueError(
                f"per-slot eviction state ({kwargs['extras']}) cannot be held once; copy prompts"
            )
        super().__init__(*args, **kwargs)
        self.width = width
        self.windows: dict[int, PrefixWindow] = {}
        kv_heads, dev = self.k[0].shape[1], self.length.device
        self.row_state[HELD] = torch.zeros(
            self.rows, self.num_layers, kv_heads, width, dtype=torch.bool, device=dev
        )

    @staticmethod
    def supports(method: EvictionMethod) -> bool:
        """Whether rows evicting by `method` can share their prompt (no per-slot state)."""
        return not method.extras and not method.needs_prefill_attention

    def hold(self, tokens: Sequence[int], src: KVCache, row: int, logits: Tensor) -> int:
        pid = self.prefix_id(tokens)
        if pid is not None:
            return pid
        n, layers = int(src.length[row]), range(self.num_layers)
        if n > self.width:
            raise RuntimeError(f"a prefix of {n} slots exceeds the {self.width} this cache holds (not cut?)")
        pid = super().hold(tokens, src, row, logits)
        self.windows[pid] = PrefixWindow(
            [src.pos[i][row, :, :n].clone() for i in layers],
            [src.queries[i][row].clone() for i in layers],
            int(src.query_count[row]),
        )
        return pid

    def append_readers(self, ids: Tensor) -> None:
        """Readers start holding every slot of their prefix, with its last queries as their window."""
        n = self.rows
        super().append_readers(ids)
        for pid in ids.unique().tolist():
            rows, window = n + (ids == pid).nonzero().squeeze(-1), self.windows[pid]
            self.row_state[HELD][rows, :, :, : window.pos[0].shape[1]] = True
            for layer in range(self.num_layers):
                self.queries[layer][rows] = window.queries[layer]
            self.query_count[rows] = window.query_count

    def row_snapshot(self, row: int) -> KVCache:
        twin = super().row_snapshot(row)
        twin.windows = {}
        return twin

    def reading(self, row: int) -> EvictingHeldPrefix | None:
        reads = super().reading(row)
        if reads is None:
            return None
        held = self.row_state[HELD][row, :, :, : reads.prefix.length].clone()
        return EvictingHeldPrefix(
            reads.tokens, reads.prefix, self.windows[self.prefix_id(reads.tokens)], held
        )

    def read_from(self, rows: Tensor, reads: EvictingHeldPrefix) -> None:
        """The rows read the prefix and hold the slots of it the state held."""
        if reads.prefix.length > self.width:
            raise RuntimeError(
                f"a prefix of {reads.prefix.length} slots exceeds the {self.width} this cache holds"
            )
        super().read_from(rows, reads)
        self.windows.setdefault(self.prefix_id(reads.tokens), reads.window)
        self.row_state[HELD][rows] = False
        self.row_state[HELD][rows, :, :, : reads.prefix.length] = reads.held

    def release_unread(self) -> None:
        """Rows that hold no slot of their prefix any more stop reading it (it is dropped when none does)."""
        holds = self.row_state[HELD].flatten(1).any(dim=1)
        self.row_state[PREFIX].mul_(holds)
        self.regroup()
        super().release_unread()
        self.windows = {pid: w for pid, w in self.windows.items() if pid in self.prefixes}

    def held(self) -> Tensor:
        """Own slots plus the prefix slots still held (as many in every layer and head)."""
        return self.length + self.row_state[HELD][:, 0, 0].sum(-1)

    def attention(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        valid: Tensor,
        scale: float,
        prefix_read: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`SharedPrefixCache.attention` reading only the prefix slots each row and head still holds (the
        mask replaces `prefix_read`: block-sparse reads never evict)."""
        width = max((prefix.length for prefix, _ in self.groups), default=0)
        read = self.row_state[HELD][:, layer, :, :width]
        return super().attention(layer, q, k, v, valid, scale, prefix_read=read)

    # ------------------------------------------------------------------------------------------ eviction

    def _width(self, idx: Tensor) -> int:
        """The longest prefix the listed rows read (0: none)."""
        pids = self.row_state[PREFIX][idx].unique().tolist()
        return max((self.prefixes[p].length for p in pids if p), default=0)

    def _with_prefix(self, idx: Tensor, own: Tensor, part: Callable[[int], Tensor]) -> Tensor:
        """[r, Hkv, W + span, ...]: each listed row's prefix slots (`part(pid)` [Hkv, L, ...], zero-padded to
        the longest prefix W the rows read), then its own slots `own` [r, Hkv, span, ...]."""
        ids = self.row_state[PREFIX][idx]
        pre = own.new_zeros((own.shape[0], own.shape[1], self._width(idx), *own.shape[3:]))
        for pid in [p for p in ids.unique().tolist() if p]:
            value = part(pid)
            pre[(ids == pid).nonzero().squeeze(-1), :, : value.shape[1]] = value
        return torch.cat([pre, own], dim=2)

    def _layout(self, layer: int, idx: Tensor) -> tuple[Tensor, Tensor, int]:
        """The copied row's order of the held slots: indices [r, Hkv, S] into `_with_prefix`'s slots (held
        prefix slots, then own ones), how many each row holds [r], and the prefix width W."""
        width, length = self._width(idx), self.length[idx]
        own = torch.arange(int(length.max()), device=idx.device)[None, None, :] < length[:, None, None]
        mask = self.row_state[HELD][idx, layer, :, :width]
        held = torch.cat([mask, own.expand(-1, mask.shape[1], -1)], dim=2)
        count = held.sum(-1)[:, 0]
        order = (~held).to(torch.int8).sort(dim=-1, stable=True).indices[..., : int(count.max())]
        return order, count, width

    def _gathered(self, layer: int, idx: Tensor, name: str, at: Tensor) -> Tensor:
        """Slots `at` [r, Hkv, X] (indices into `_with_prefix`'s slots) of keys, values or positions."""
        own = getattr(self, name)[layer][idx, :, : int(self.length[idx].max())]
        if name == "pos":
            full = self._with_prefix(idx, own, lambda p: self.windows[p].pos[layer])
            return full.gather(2, at)
        stored = self.prefixes
        full = self._with_prefix(idx, own, lambda p: getattr(stored[p], name)[layer])
        return full.gather(2, at[..., None].expand(-1, -1, -1, full.shape[-1]))

    def eviction_slots(
        self, layer: int, rows: Tensor | slice
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
        idx = torch.arange(self.rows, device=self.length.device)[rows]
        order, count, _ = self._layout(layer, idx)
        return self._gathered(layer, idx, "k", order), self._gathered(layer, idx, "pos", order), {}, count

    def keep_slots(self, rows: Tensor | slice, slots: list[Tensor]) -> None:
        """Keep the chosen slots: each head's last `own` chosen ones in the row's own slots (`own`: the most
        own slots any layer and head of the row kept), the earlier ones (all in the prefix) in its mask."""
        idx = torch.arange(self.rows, device=self.length.device)[rows]
        target = slots[0].shape[-1]
        layouts = [self._layout(layer, idx) for layer in range(self.num_layers)]
        chosen = [order.gather(2, kept) for (order, _, _), kept in zip(layouts, slots, strict=True)]
        own = torch.stack([(c >= w).sum(-1) for c, (_, _, w) in zip(chosen, layouts, strict=True)])
        own = own.amax(dim=(0, 2))  # [r]
        longest = int(own.max())
        take = (target - own[:, None] + torch.arange(longest, device=idx.device)).clamp(max=target - 1)
        in_prefix = torch.arange(target, device=idx.device) < (target - own)[:, None]  # [r, target]
        for layer, (c, (_, _, width)) in enumerate(zip(chosen, layouts, strict=True)):
            at = c.gather(2, take[:, None, :].expand(-1, c.shape[1], -1))
            moved = {name: self._gathered(layer, idx, name, at) for name in ("k", "v", "pos")}
            for name, value in moved.items():
                getattr(self, name)[layer][idx, :, :longest] = value
            mark = torch.where(in_prefix[:, None, :] & (c < width), c, width)
            mask = torch.zeros(*c.shape[:2], width + 1, dtype=torch.bool, device=c.device)
            self.row_state[HELD][idx, layer] = False
            self.row_state[HELD][idx, layer, :, :width] = mask.scatter_(2, mark, True)[..., :width]
        self.length[idx] = own
        self.release_unread()
