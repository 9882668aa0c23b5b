"""A group's prompt KV held once and read by all its rows (BroRL-scale groups: hundreds of samples a prompt), and
likewise the history that children forked at one token start from.

With a copied prompt every row of a group holds its own copy of the prompt's keys and values: n copies in memory,
and n reads of them at every decode step. Here the prompt's KV is stored once per group and each row holds only
its own tokens; a decode step's attention is the softmax over [the shared prompt's keys ++ the row's own keys],
computed exactly as one softmax over the concatenated scores. The prompt part of a group is one matrix product
for all its rows (their queries stacked), so the prompt is read once a step, not once a row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl.engine.cache import KVCache

PREFIX = "prefix"  # row_state entry: the id of the prefix a row reads (0: none)


@dataclass
class SharedPrefix:
    """One prompt's keys and values per layer [Hkv, L, D] (RoPE applied, positions 0..L-1) and the next-token
    logits [V] after it (every row of the group samples its first token from them).

    With pages (block-sparse reads), L is the prompt's whole pages: `paged` holds their per-page row state (page
    summaries, [Hkv, L / page, ...]) and the rest of the prompt, `tail_k`/`tail_v` [Hkv, T, D] (T < a page),
    is copied into each reader's own first slots, so that a row's own pages stay whole pages of positions."""

    k: list[Tensor]
    v: list[Tensor]
    logits: Tensor
    tail_k: list[Tensor]
    tail_v: list[Tensor]
    paged: dict[str, Tensor]

    @property
    def length(self) -> int:
        return self.k[0].shape[1]

    @property
    def positions(self) -> int:
        """Positions of the input it stands for: held once and in the readers' tail (fewer: cut by eviction)."""
        return self.length + self.tail_k[0].shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.tail_k, *self.tail_v))


@dataclass
class HeldPrefix:
    """What a row reads held once, kept by a fork state of the row (engine/forks.py): the input's tokens and its
    `SharedPrefix`. A child forked from the state reads the same prefix in whichever run it joins (the run holds
    it again if no row reads it any more), so the state holds only the row's own slots."""

    tokens: tuple[int, ...]
    prefix: SharedPrefix


def shared_inputs(inputs: Sequence[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """The inputs (prompt + given completion tokens) that two or more requests start from: a group's prompt, or
    the common history of tree children forked at one token."""
    return {seq for seq, count in Counter(inputs).items() if count >= 2}


def _per_head(x: Tensor) -> Tensor:
    """[m, Hkv, G, X] -> [Hkv, m * G, X]: the queries (or probabilities) of a group's rows stacked per KV head."""
    m, hkv, g, w = x.shape
    return x.transpose(0, 1).reshape(hkv, m * g, w)


def _per_row(x: Tensor, m: int) -> Tensor:
    """The inverse of `_per_head`: [Hkv, m * G, X] -> [m, Hkv, G, X]."""
    hkv, mg, w = x.shape
    return x.view(hkv, m, mg // m, w).transpose(0, 1)


def held_once(length: int, align: int) -> int:
    """Positions of a `length`-position input that are held once: its whole `align`-position pages (all of it at
    align 1); the rest stays in each reader's own row."""
    return length // align * align


class SharedPrefixCache(KVCache):
    """A `KVCache` whose rows may read a shared prefix before their own slots.

    `hold(tokens, src, row, logits)` keeps one prompt's KV once (by its tokens); `append_readers(ids)` adds rows
    that read prefixes and hold no slot of their own yet (or a prefix's tail). A row's prefix id is row state, so
    it moves with the row; a prefix that no live row reads is released. Rows with no prefix (id 0) attend as in
    `KVCache`. With `align` > 1 (block-sparse reads: the page size) a prefix holds whole pages only.
    """

    reading_state: tuple[str, ...] = (PREFIX,)  # the row state saying what a row reads (kept by `reading`)

    def __init__(self, *args, align: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.align = align
        self.prefixes: dict[int, SharedPrefix] = {}
        self._ids: dict[tuple[int, ...], int] = {}
        self._next_id = 1
        self.row_state[PREFIX] = torch.zeros(self.rows, dtype=torch.long, device=self.length.device)

    def _views(self) -> None:
        super()._views()
        self.regroup()

    def regroup(self) -> None:
        """The rows moved, or what they read changed: group them again when next asked."""
        self._groups: list[tuple[SharedPrefix, Tensor]] | None = None
        self._prefix_lengths: Tensor | None = None

    def prefix_id(self, tokens: Sequence[int]) -> int | None:
        """The id of the held prefix of these tokens, if any."""
        return self._ids.get(tuple(tokens))

    def hold(self, tokens: Sequence[int], src: KVCache, row: int, logits: Tensor) -> int:
        """Keep row `row` of a prefilled `src` (all its slots: a whole prompt) as the prefix `tokens`; its id."""
        held = self.prefix_id(tokens)
        if held is not None:
            return held
        n, layers = int(src.length[row]), range(self.num_layers)
        keep = held_once(n, self.align)
        prefix = SharedPrefix(
            [src.k[i][row, :, :keep].clone() for i in layers],
            [src.v[i][row, :, :keep].clone() for i in layers],
            logits,
            [src.k[i][row, :, keep:n].clone() for i in layers],
            [src.v[i][row, :, keep:n].clone() for i in layers],
            {name: src.row_state[name][row, :, : keep // ps].clone() for name, ps in src.paged_state.items()},
        )
        for name, ps in src.paged_state.items():  # page state (summaries) of the readers' own pages
            if name not in self.row_state:
                state = src.row_state[name]
                self.paged_state[name] = ps
                self.row_state[name] = state.new_zeros(
                    (self.rows, state.shape[1], -(-self.capacity // ps), *state.shape[3:])
                )
        return self._register(tokens, prefix)

    def _register(self, tokens: Sequence[int], prefix: SharedPrefix) -> int:
        """Hold `prefix` as the input `tokens` under a new id; the id."""
        pid, self._next_id = self._next_id, self._next_id + 1
        self.prefixes[pid], self._ids[tuple(tokens)] = prefix, pid
        return pid

    def append_readers(self, ids: Tensor) -> None:
        """Add one row per entry of `ids` [k], each reading the prefix of that id and holding its tail."""
        n, k = self.rows, ids.numel()
        self.reserve_rows(n + k)
        for t in self._store.values():
            t[n : n + k] = 0
        self._store[f"state.{PREFIX}"][n : n + k] = ids
        for pid in ids.unique().tolist():
            prefix = self.prefixes[pid]
            tail = prefix.tail_k[0].shape[1]
            if tail:
                rows = n + (ids == pid).nonzero().squeeze(-1)
                for layer in range(self.num_layers):
                    self._store[f"k.{layer}"][rows, :, :tail] = prefix.tail_k[layer]
                    self._store[f"v.{layer}"][rows, :, :tail] = prefix.tail_v[layer]
                    positions = torch.arange(prefix.length, prefix.length + tail, device=rows.device)
                    self._store[f"pos.{layer}"][rows, :, :tail] = positions.to(torch.int32)
                self._store["length"][rows] = tail
        self._rows = n + k
        self._views()

    def adopt(self, reads: HeldPrefix) -> int:
        """The id of the prefix `reads` stands for: the one held for its tokens, else it, held again."""
        held = self.prefix_id(reads.tokens)
        return held if held is not None else self._register(reads.tokens, reads.prefix)

    def row_snapshot(self, row: int) -> KVCache:
        """The row's own slots only, reading nothing (what it reads is `reading(row)`)."""
        twin = super().row_snapshot(row)
        for name in self.reading_state:
            del twin._store[f"state.{name}"]
        twin.prefixes, twin._ids = {}, {}
        twin._views()
        return twin

    def reading(self, row: int) -> HeldPrefix | None:
        pid = int(self.row_state[PREFIX][row])
        if not pid:
            return None
        tokens = next(t for t, p in self._ids.items() if p == pid)
        return HeldPrefix(tokens, self.prefixes[pid])

    def read_from(self, rows: Tensor, reads: HeldPrefix) -> None:
        self.row_state[PREFIX][rows] = self.adopt(reads)
        self.regroup()

    def holds(self, prefix: SharedPrefix) -> bool:
        return any(p is prefix for p in self.prefixes.values())

    def retire(self, rows: Tensor) -> Tensor:
        order = super().retire(rows)
        self.release_unread()
        return order

    def release_unread(self) -> None:
        """Drop the prefixes no live row reads."""
        read = set(self.row_state[PREFIX].unique().tolist())
        for pid in [p for p in self.prefixes if p not in read]:
            del self.prefixes[pid]
        self._ids = {tokens: pid for tokens, pid in self._ids.items() if pid in self.prefixes}

    @property
    def groups(self) -> list[tuple[SharedPrefix, Tensor]]:
        """Each held prefix with the rows [m] that read it."""
        if self._groups is None:
            ids = self.row_state[PREFIX]
            self._groups = [
                (self.prefixes[pid], (ids == pid).nonzero().squeeze(-1))
                for pid in ids.unique().tolist()
                if pid
            ]
        return self._groups

    def prefix_lengths(self) -> Tensor:
        """[rows] positions each row reads from its shared prefix before its own slots (0: none); kept until the
        rows move (every sparse layer of a step asks)."""
        if self._prefix_lengths is None:
            self._prefix_lengths = torch.zeros_like(self.length)
            for prefix, rows in self.groups:
                self._prefix_lengths[rows] = prefix.length
        return self._prefix_lengths

    def held(self) -> Tensor:
        return self.length + self.prefix_lengths()

    def shared_bytes(self) -> int:
        return sum(p.nbytes() for p in self.prefixes.values())

    def nbytes(self) -> int:
        return super().nbytes() + self.shared_bytes()

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
        """Softmax over [each row's prefix keys ++ its own keys], one softmax over the concatenated scores (a
        shorter prefix padded with -inf); a group's prefix scores and outputs are one matrix product for all its
        rows. `prefix_read` [rows, Hkv, longest prefix] masks the prefix positions each KV head reads (block-sparse
        reads; default all). Returns the output and the probabilities over the row's own slots (as
        `KVCache.attention`)."""
        groups = self.groups
        if not groups:
            return super().attention(layer, q, k, v, valid, scale)
        n, hq, _, d = q.shape
        hkv = k.shape[1]
        qg = q.view(n, hkv, hq // hkv, d) * scale
        width = max(prefix.length for prefix, _ in groups)
        scores = qg.new_full((n, hkv, hq // hkv, width + k.shape[2]), float("-inf"))
        own = torch.matmul(qg, k.transpose(-1, -2))
        mask = valid[:, None, None, :] if valid.dim() == 2 else valid[:, :, None, :]
        scores[..., width:] = own.masked_fill_(~mask, float("-inf"))
        for prefix, rows in groups:
            part = torch.matmul(_per_head(qg[rows]), prefix.k[layer].transpose(-1, -2))
            scores[rows, :, :, : prefix.length] = _per_row(part, rows.numel())
        if prefix_read is not None:
            scores[..., :width].masked_fill_(~prefix_read[:, :, None, :], float("-inf"))
        p32 = scores.softmax(dim=-1, dtype=torch.float32)
        probs = p32.to(v.dtype)
        out = torch.matmul(probs[..., width:], v)
        for prefix, rows in groups:
            part = torch.matmul(_per_head(probs[rows, :, :, : prefix.length]), prefix.v[layer])
            out[rows] += _per_row(part, rows.numel())
        return out.view(n, hq, 1, d), p32[..., width:]
