"""A preallocated, ragged KV cache: one row per sequence, its held positions packed at the left of each row.

Why not transformers' caches: they grow by concatenation (a full copy per step), pad ragged batches, and have no
notion of evicting positions per row and per head while keeping their true RoPE positions.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys, values and true positions of every held slot, per layer: [rows, kv_heads, capacity, (head_dim)].

    All heads and layers of a row hold the same number of slots (`length[row]`); which positions they hold
    may differ per layer and head after per-head eviction. Slots stay in chronological order.
    Per-slot extras (e.g. H2O's accumulated attention) and the last `window` queries of each layer travel with
    their rows so that eviction methods can score at any step; so does `row_state`, any tensors whose first
    dimension is the row (e.g. block-sparse attention's page summaries), which their owner adds.
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
        self.capacity = capacity
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pos = [torch.zeros(shape[:3], dtype=torch.int32, device=device) for _ in range(num_layers)]
        self.extras = {
            name: [torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(num_layers)]
            for name in extras
        }
        self.queries = [
            torch.zeros(rows, num_heads, window, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.query_count = torch.zeros(rows, dtype=torch.long, device=device)
        self.length = torch.zeros(rows, dtype=torch.long, device=device)
        self.row_state: dict[str, Tensor] = {}

    @property
    def rows(self) -> int:
        return self.length.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (the memory that grows with context)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_position(self) -> int:
        """Bytes one held position costs across all layers (keys + values)."""
        _, h, _, d = self.k[0].shape
        return 2 * self.num_layers * h * d * self.k[0].element_size()

    def fill(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, lengths: Tensor) -> None:
        """Write a prefilled block [rows, H, T, D] left-aligned; `lengths` are the real tokens of each row."""
        t = k.shape[2]
        self.k[layer][:, :, :t] = k
        self.v[layer][:, :, :t] = v
        self.pos[layer][:, :, :t] = positions.to(torch.int32)[:, None, :]
        self.length = lengths.clone()

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

    def view(self, layer: int, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values of the first `span` slots (no copy)."""
        return self.k[layer][:, :, :span], self.v[layer][:, :, :span]

    def valid(self, span: int, extra: int = 0) -> Tensor:
        """[rows, span] mask of held slots, counting `extra` pending slots per row."""
        return torch.arange(span, device=self.length.device)[None, :] < (self.length + extra)[:, None]

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
        for store in (self.pos, *self.extras.values()):
            store[layer][rows, :, :b] = torch.gather(store[layer][rows, :, :span], 2, slots)
        for store in self.extras.values():  # freed slots start from zero when a new token is written there
            store[layer][rows, :, b:] = 0

    def select_rows(self, rows: Tensor, capacity: int | None = None) -> None:
        """Keep (or repeat) the given rows in that order, optionally cutting every row to `capacity` slots.

        Used to drop finished sequences and to give a prompt's KV to each of its n samples. Keeping every row
        in place at the same capacity (n = 1, dense) is a no-op rather than a copy of the whole cache.
        """
        same_capacity = capacity is None or capacity == self.capacity
        if (
            same_capacity
            and rows.numel() == self.rows
            and bool((rows == torch.arange(self.rows, device=rows.device)).all())
        ):
            return
        if capacity is not None:
            if int(self.length.max()) > capacity:
                raise RuntimeError(f"cannot shrink the KV cache to {capacity} slots: a row holds more")
            self.capacity = capacity
        for store in (self.k, self.v, self.pos, *self.extras.values()):
            for i, t in enumerate(store):
                store[i] = t[:, :, : self.capacity].index_select(0, rows)
        self.queries = [t.index_select(0, rows) for t in self.queries]
        self.row_state = {name: t.index_select(0, rows) for name, t in self.row_state.items()}
        self.length = self.length.index_select(0, rows)
        self.query_count = self.query_count.index_select(0, rows)
