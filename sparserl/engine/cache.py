"""A preallocated, ragged KV cache: one row per sequence, its held positions packed at the left of each row.

Why not transformers' caches: they grow by concatenation (a full copy per step), pad ragged batches, and have no
notion of evicting positions per row and per head while keeping their true RoPE positions.

Rows come and go (continuous batching): a finished row is filled by the last row (a move of one row, not a
copy of the cache), and new rows are appended into storage reserved beyond the live rows. The public tensors
(`k`, `v`, `pos`, `extras`, `queries`, `length`, `query_count`, `row_state`) are views of the live rows.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparserl.engine.decoder import decode_attention

if TYPE_CHECKING:
    from sparserl.engine.shared_prefix import HeldPrefix, SharedPrefix


class KVCache:
    """Keys, values and true positions of every held slot, per layer: [rows, kv_heads, capacity, (head_dim)].

    All heads and layers of a row hold the same number of slots (`length[row]`); which positions they hold
    may differ per layer and head after per-head eviction. Slots stay in chronological order.
    Per-slot extras (e.g. H2O's accumulated attention) and the last `window` queries of each layer travel with
    their rows so that eviction methods can score at any step; so does `row_state`, any tensors whose first
    dimension is the row (e.g. block-sparse attention's page summaries), which their owner adds; those named in
    `paged_state` (name -> page size) have a page axis (dim 2) that grows with the capacity.
    """

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        num_heads: int,
        head_dim: int,
        capacity: int,
        window: int,
        dtype: torch.dtype,
        device: torch.device,
        extras: tuple[str, ...] = (),
    ):
        shape = (rows, kv_heads, capacity, head_dim)
        self.capacity, self.num_layers = capacity, num_layers
        self._rows = rows
        self._store: dict[str, Tensor] = {}  # every per-row tensor, [reserved rows, ...]
        for layer in range(num_layers):
            self._new_kv(layer, shape, dtype, device)
            self._store[f"pos.{layer}"] = torch.zeros(shape[:3], dtype=torch.int32, device=device)
            for name in extras:
                self._store[f"x.{name}.{layer}"] = torch.zeros(shape[:3], dtype=torch.float32, device=device)
            self._store[f"q.{layer}"] = torch.zeros(
                rows, num_heads, window, head_dim, dtype=dtype, device=device
            )
        self._store["length"] = torch.zeros(rows, dtype=torch.long, device=device)
        self._store["query_count"] = torch.zeros(rows, dtype=torch.long, device=device)
        self._extra_names = extras
        self.paged_state: dict[str, int] = {}
        self._views()

    def _new_kv(self, layer: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """Allocate one layer's keys and values [rows, Hkv, capacity, D] (a quantized cache: codes and scales)."""
        self._store[f"k.{layer}"] = torch.zeros(shape, dtype=dtype, device=device)
        self._store[f"v.{layer}"] = torch.zeros(shape, dtype=dtype, device=device)

    def _views(self) -> None:
        """Point the public tensors at the live rows of the storage."""
        s, n, layers = self._store, self._rows, range(self.num_layers)
        self.k = [s[f"k.{i}"][:n] for i in layers]
        self.v = [s[f"v.{i}"][:n] for i in layers]
        self.pos = [s[f"pos.{i}"][:n] for i in layers]
        self.extras = {name: [s[f"x.{name}.{i}"][:n] for i in layers] for name in self._extra_names}
        self.queries = [s[f"q.{i}"][:n] for i in layers]
        self.length, self.query_count = s["length"][:n], s["query_count"][:n]
        self.row_state = _RowState(self, {k[6:]: t[:n] for k, t in s.items() if k.startswith("state.")})

    def mark_static_addresses(self) -> None:
        """Tell torch.compile that the live rows' tensors keep their addresses from step to step, so that the
        CUDA graph of the compiled step reads and writes them in place instead of copying them in and out at
        every replay (`guard=False`: a new address, after a resize, records a new graph, not a recompile)."""
        tensors = [*self.k, *self.v, *self.pos, *self.queries, self.length, self.query_count]
        tensors += [t for per_layer in self.extras.values() for t in per_layer]
        for t in [*tensors, *self.row_state.values()]:
            torch._dynamo.mark_static_address(t, guard=False)

    def clone(self) -> KVCache:
        """An independent copy (every stored tensor cloned): how a kept prefill is handed out again."""
        twin = copy.copy(self)
        twin._store = {name: t.clone() for name, t in self._store.items()}
        twin.paged_state = dict(self.paged_state)
        twin._views()
        return twin

    def row_snapshot(self, row: int) -> KVCache:
        """Row `row` as a cache of its own, cut to the slots it holds (every stored tensor's row cloned): the
        state a fork continues from (engine/forks.py)."""
        held = int(self.length[row])
        twin = copy.copy(self)
        twin._store = {}
        for name, t in self._store.items():
            part, axis = t[row : row + 1], self._slot_axis(name)
            if axis is not None:
                part = part.narrow(axis, 0, min(part.shape[axis], self._slots(name, held)))
            twin._store[name] = part.clone()
        twin._rows, twin.capacity, twin.paged_state = 1, held, dict(self.paged_state)
        twin._views()
        return twin

    def reading(self, row: int) -> HeldPrefix | None:
        """What row `row` reads held once beside its own slots (none here; `SharedPrefixCache`): a fork state of
        the row keeps it, so that a child forked from the state reads it too."""
        return None

    def read_from(self, rows: Tensor, reads: HeldPrefix) -> None:
        """Let rows `rows` read `reads` before their own slots (a fork state's input held once)."""
        raise RuntimeError(
            f"a {type(self).__name__} holds no input once: a fork state reading one joins a run that shares"
            " prompts (DecodeRun picks a SharedPrefixCache when a fork reads one)"
        )

    def holds(self, prefix: SharedPrefix) -> bool:
        """Whether this cache holds (and counts in `nbytes`) that input held once."""
        return False

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def reserved_rows(self) -> int:
        return self._store["length"].shape[0]

    def row_bytes(self, row: int) -> int:
        """The keys and values `row_snapshot(row)` holds, without making it."""
        return int(self.length[row]) * self.bytes_per_position()

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (the memory that grows with context), reserved rows included."""
        return sum(
            t.numel() * t.element_size() for name, t in self._store.items() if name[:2] in ("k.", "v.")
        )

    def bytes_per_position(self) -> int:
        """Bytes one held position costs across all layers (keys + values)."""
        _, h, _, d = self.k[0].shape
        return 2 * self.num_layers * h * d * self.k[0].element_size()

    def full_precision_bytes_per_position(self) -> int:
        """What a position costs unquantized, in the compute dtype (the dense engine's figure)."""
        return self.bytes_per_position()

    def fill(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, lengths: Tensor) -> None:
        """Write a prefilled block [rows, H, T, D] left-aligned; `lengths` are the real tokens of each row."""
        t = k.shape[2]
        self.k[layer][:, :, :t] = k
        self.v[layer][:, :, :t] = v
        self.pos[layer][:, :, :t] = positions.to(torch.int32)[:, None, :]
        self.length.copy_(lengths)

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Write one new token [rows, H, 1, D] at slot `length[row]` of every row (committed by `advance`)."""
        rows = torch.arange(self.rows, device=k.device)
        slot = self.length
        self.k[layer][rows, :, slot] = k[:, :, 0]
        self.v[layer][rows, :, slot] = v[:, :, 0]
        self.pos[layer][rows, :, slot] = positions.to(torch.int32)[:, None]

    def advance(self) -> None:
        self.length += 1

    def remember_queries(self, layer: int, q: Tensor) -> None:
        """Keep the newest query [rows, Hq, 1, D] in a ring of the last `window` queries."""
        w = self.queries[layer].shape[2]
        rows = torch.arange(self.rows, device=q.device)
        self.queries[layer][rows, :, self.query_count % w] = q[:, :, 0]

    def held(self) -> Tensor:
        """[rows] positions each row's attention holds: its own slots (a shared prefix's too, in a subclass)."""
        return self.length

    def shared_bytes(self) -> int:
        """Bytes of keys and values held once for several rows (none here: every row holds its own)."""
        return 0

    def attention(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float
    ) -> tuple[Tensor, Tensor]:
        """One decode step's attention of `layer`: queries q [rows, Hq, 1, D] over the keys and values the step
        reads (k, v [rows, Hkv, S, D] under the mask `valid`); returns `decode_attention`'s output and
        probabilities over those S slots."""
        return decode_attention(q, k, v, valid, scale)

    def attend(self, layer: int, q: Tensor, valid: Tensor, span: int, scale: float) -> tuple[Tensor, Tensor]:
        """`attention` of queries q [rows, Hq, 1, D] over the first `span` slots of every row."""
        k, v = self.view(layer, span)
        return self.attention(layer, q, k, v, valid, scale)

    def view(self, layer: int, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values of the first `span` slots (no copy)."""
        return self.k[layer][:, :, :span], self.v[layer][:, :, :span]

    def gather(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values [rows, Hkv, R, D] of the slots [rows, Hkv, R] of one layer (block-sparse reads)."""
        return gather_slots(self.k[layer], slots), gather_slots(self.v[layer], slots)

    def slot_keys(self, layer: int, rows: Tensor, slots: Tensor) -> Tensor:
        """Keys [f, Hkv, s, D] of the slots [f, s] of the rows [f] (the same slots in every head)."""
        heads = torch.arange(self.k[layer].shape[1], device=rows.device)[None, :, None]
        return self.k[layer][rows[:, None, None], heads, slots[:, None, :]]

    def valid(self, span: int, extra: int = 0) -> Tensor:
        """[rows, span] mask of held slots, counting `extra` pending slots per row."""
        return torch.arange(span, device=self.length.device)[None, :] < (self.length + extra)[:, None]

    def eviction_slots(
        self, layer: int, rows: Tensor | slice
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
        """What an eviction method scores in one layer of the given rows: keys [r, Hkv, S, D], positions
        [r, Hkv, S] and per-slot extras of each row's held slots in chronological order, and the number each
        row holds [r] (S: the most); `keep_slots` takes indices into these slots."""
        length = self.length[rows]
        span = int(length.max())
        extras = {name: store[layer][rows, :, :span] for name, store in self.extras.items()}
        return self.k[layer][rows, :, :span], self.pos[layer][rows, :, :span], extras, length

    def keep_slots(self, rows: Tensor | slice, slots: list[Tensor]) -> None:
        """Keep, in every layer, the slots [r, H, B] of `eviction_slots` that `slots[layer]` lists (each row
        then holds B)."""
        for layer, kept in enumerate(slots):
            self.keep(rows, layer, kept)
        self.length[rows] = slots[0].shape[-1]

    def keep(self, rows: Tensor | slice, layer: int, slots: Tensor) -> None:
        """Keep only `slots` [rows, H, B] (chronological) of the given rows in one layer, packed left.

        `rows` is an index tensor or `slice(None)` for all rows (no copy of the untouched rows then).
        """
        b, span = slots.shape[-1], int(slots.max()) + 1
        for store in (self.k, self.v):
            src = store[layer][rows, :, :span]
            store[layer][rows, :, :b] = torch.gather(
                src, 2, slots[..., None].expand(-1, -1, -1, src.shape[-1])
            )
        for store in self._slot_tensors(layer):
            store[rows, :, :b] = torch.gather(store[rows, :, :span], 2, slots)
        for store in self.extras.values():  # freed slots start from zero when a new token is written there
            store[layer][rows, :, b:] = 0

    def _slot_tensors(self, layer: int) -> list[Tensor]:
        """One layer's per-slot tensors [rows, Hkv, capacity] beside keys and values (kept with their slots)."""
        return [self.pos[layer], *(store[layer] for store in self.extras.values())]

    # ---------------------------------------------------------------------------------------- rows and slots

    def _slot_axis(self, name: str) -> int | None:
        """The axis of a stored tensor that grows with the capacity (in pages for paged row state)."""
        if name[:2] in ("k.", "v.") or name.startswith(("pos.", "x.")):
            return 2
        return 2 if name.startswith("state.") and name[6:] in self.paged_state else None

    def _slots(self, name: str, capacity: int | None = None) -> int:
        """The size of a stored tensor's slot axis at `capacity` (default: the current one)."""
        capacity = self.capacity if capacity is None else capacity
        return -(-capacity // self.paged_state[name[6:]]) if name.startswith("state.") else capacity

    def resize(self, capacity: int, reserve: int | None = None) -> None:
        """Hold `capacity` slots per row from now on (grow, or shrink when no row holds more), with storage for
        `reserve` rows (default: as many as now; never fewer than the live rows)."""
        reserve = max(self.rows, self.reserved_rows if reserve is None else reserve)
        if capacity == self.capacity and reserve == self.reserved_rows:
            return
        if self.rows and int(self.length.max()) > capacity:
            raise RuntimeError(f"cannot shrink the KV cache to {capacity} slots: a row holds more")
        for name, t in self._store.items():
            shape, axis, live = [reserve, *t.shape[1:]], self._slot_axis(name), t[: self.rows]
            if axis is not None:
                shape[axis] = self._slots(name, capacity)
                live = live.narrow(axis, 0, min(t.shape[axis], shape[axis]))
            grown = t.new_zeros(shape)
            grown[tuple(slice(0, n) for n in live.shape)] = live
            self._store[name] = grown
        self.capacity = capacity
        self._views()

    def reserve_rows(self, rows: int) -> None:
        """Make room for `rows` rows in storage (new rows are appended there without moving the others)."""
        if rows > self.reserved_rows:
            self.resize(self.capacity, rows)

    def retire(self, rows: Tensor) -> Tensor:
        """Drop the given rows; the last live rows move into the holes (one row copy each). Returns, for each
        remaining row, its index before the call, so that owners of per-row data can follow."""
        n = self._rows
        gone = torch.zeros(n, dtype=torch.bool, device=rows.device)
        gone[rows] = True
        order = torch.arange(n, device=rows.device)
        new_n = n - int(gone.sum())
        holes = gone[:new_n].nonzero().squeeze(-1)
        movers = (~gone[new_n:]).nonzero().squeeze(-1) + new_n
        if holes.numel():
            for t in self._store.values():
                t[holes] = t[movers]
            order[holes] = movers
        self._rows = new_n
        self._views()
        return order[:new_n]

    @contextmanager
    def padded(self, rows: int) -> Iterator[None]:
        """Show `rows` rows (the live ones, then reserved storage) while the block runs: a compiled step's
        fixed batch. The rows past the live ones are scratch that an `append` overwrites whole."""
        live = self._rows
        if rows == live:
            yield
            return
        if rows > self.reserved_rows:
            raise RuntimeError(f"cannot show {rows} rows: {self.reserved_rows} are reserved")
        self._rows = rows
        self._views()
        try:
            yield
        finally:
            self._rows = live
            self._views()

    def append(self, src: KVCache, rows: Tensor) -> None:
        """Add rows `rows` of `src` (repeats allowed: a prompt's KV for each of its samples) after the live
        rows; no row may hold more slots than this cache has. Slots past a source row's storage start empty."""
        if int(src.length[rows].max()) > self.capacity:
            raise RuntimeError(f"cannot append rows holding {int(src.length.max())} slots to {self.capacity}")
        for name, t in src._store.items():  # state its owner added to the source (e.g. page summaries)
            if name not in self._store:
                self.paged_state.update(src.paged_state)
                shape = [self.reserved_rows, *t.shape[1:]]
                if (axis := self._slot_axis(name)) is not None:
                    shape[axis] = self._slots(name)
                self._store[name] = t.new_zeros(shape)
        n, k = self._rows, rows.numel()
        self.reserve_rows(n + k)
        for name, t in self._store.items():
            dst = t[n : n + k]
            if name not in src._store:  # state only this cache carries (a shared prefix's id) starts empty
                dst.zero_()
                continue
            part, axis = src._store[name][rows], self._slot_axis(name)
            if axis is None:
                dst.copy_(part)
            else:
                width = min(part.shape[axis], t.shape[axis])
                dst.narrow(axis, 0, width).copy_(part.narrow(axis, 0, width))
                dst.narrow(axis, width, t.shape[axis] - width).zero_()
        self._rows = n + k
        self._views()


def gather_slots(store: Tensor, slots: Tensor) -> Tensor:
    """store[r, h, slots[r, h, i]] for a whole cache layer [rows, Hkv, capacity, D] and slots [rows, Hkv, R]:
    one index_select over the flattened layer (a third of the time of advanced indexing on a CPU)."""
    rows, hkv, capacity, d = store.shape
    base = torch.arange(rows * hkv, device=slots.device).view(rows, hkv, 1) * capacity
    return store.view(-1, d).index_select(0, (base + slots).flatten()).view(rows, hkv, -1, d)


class _RowState(dict):
    """`cache.row_state`: setting an entry stores it with the cache's rows (it then moves with them). It refers
    to its cache weakly: a strong reference back would make every cache a reference cycle, its gigabytes freed
    only whenever Python's cycle collector next runs instead of when the cache's last user lets go."""

    def __init__(self, cache: KVCache, views: dict[str, Tensor]):
        super().__init__(views)
        self._cache = weakref.proxy(cache)

    def __setitem__(self, name: str, value: Tensor) -> None:
        if value.shape[0] != self._cache.rows:
            raise ValueError(f"row_state[{name!r}] has {value.shape[0]} rows, the cache {self._cache.rows}")
        store = value.new_zeros((self._cache.reserved_rows, *value.shape[1:]))
        store[: value.shape[0]] = value
        self._cache._store[f"state.{name}"] = store
        super().__setitem__(name, store[: value.shape[0]])


def dense_kv_bytes(
    bytes_per_position: float, rows: int, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> float:
    """What a naive per-row cache allocates for a batch of `rows` sequences: every row holds the longest of
    `prompts` plus `max_new_tokens` positions of `bytes_per_position` bytes. The dense engine allocates less (a
    group's prompt held once): `engine.allocation.dense_kv_allocation` is its own figure."""
    return float(bytes_per_position) * rows * (max(len(p) for p in prompts) + max_new_tokens)
