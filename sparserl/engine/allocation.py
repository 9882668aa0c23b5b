"""Which KV cache a decoding run holds and how much it allocates: the cache's kind, the block and row rounding the
running cache uses, the positions a request's own row holds, and what the dense engine allocates for a batch, the
yardstick of the KV memory a sparse cache saves. `DecodeRun` sizes its cache with the same functions, so the yardstick cannot drift from
what the dense engine really does (a test compares it with a dense run's measured peak)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from sparserl.engine.cache import KVCache
from sparserl.engine.evicting_prefix import EvictingPrefixCache
from sparserl.engine.kv_quant import QuantizedKVCache
from sparserl.engine.shared_prefix import SharedPrefixCache, held_once, shared_inputs

if TYPE_CHECKING:
    from sparserl.engine.decoding import Request
    from sparserl.engine.rollout import RolloutEngine

CAPACITY_BUCKET = 128  # slots are allocated in blocks of this many positions (a compiled step's capacity too)
COMPILED_MIN_ROWS = 4  # fewer live rows decode eagerly: the compiled step would save ~ms and cost a graph


def in_blocks(positions: int) -> int:
    """`positions` rounded up to whole blocks of CAPACITY_BUCKET."""
    return -(-positions // CAPACITY_BUCKET) * CAPACITY_BUCKET


def row_bucket(rows: int) -> int:
    """The rows a compiled step runs for `rows` live rows: the next power of two from COMPILED_MIN_ROWS on (4,
    8, 16, 32, 64, ...), so a handful of graphs serve every batch size (a batch of 32 whose rows finish one by
    one uses 32, 16, 8 and 4) and at most half is padding."""
    size = COMPILED_MIN_ROWS
    while size < rows:
        size *= 2
    return size


def first_input(request: Request) -> tuple[int, ...]:
    """What a request's first admission prefills: its prompt and the completion tokens it was given."""
    return tuple(request.prompt) + tuple(request.prefix)


def held_once_inputs(requests: Sequence[Request]) -> set[tuple[int, ...]]:
    """The inputs a run holds once: the first inputs that two or more requests not started from a fork state
    start from, and the inputs the fork states read held once (a tree's prompt, engine/forks.py)."""
    starts = shared_inputs([first_input(r) for r in requests if r.fork is None])
    return starts | {r.fork.reads.tokens for r in requests if r.fork is not None and r.fork.reads is not None}


def read_once(request: Request, shared: Collection[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The input a request's first admission reads held once, if any: the one its fork state reads, or else its
    first input when two or more requests start from it (`shared`)."""
    if request.fork is not None:
        return request.fork.reads.tokens if request.fork.reads is not None else None
    first = first_input(request)
    return first if first in shared else None


def own_positions(request: Request, shared: Collection[tuple[int, ...]], align: int = 1) -> int:
    """Positions a request's own row holds at its end: prompt + max_new_tokens, less the input it reads held once
    (`read_once`; whole `align`-position pages of it under block-sparse reads)."""
    read = read_once(request, shared)
    return len(request.prompt) + request.max_new_tokens - (held_once(len(read), align) if read else 0)


def dense_kv_allocation(
    requests: Sequence[Request], bytes_per_position: int, compiled: bool = False, cap: int | None = None
) -> int:
    """KV bytes the dense engine allocates for `requests` admitted together: every row as many positions as the
    longest row needs (`own_positions`), plus each input held once (`held_once_inputs`: a GRPO group's prompt,
    `SharedPrefixCache`). A compiled step holds copies instead, its capacity in
    whole blocks and its rows padded to a `row_bucket`. Under a KV memory `cap` the dense engine never holds more
    than the cap."""
    shared = set() if compiled else held_once_inputs(requests)
    capacity, rows = max(own_positions(r, shared) for r in requests), len(requests)
    if compiled:
        capacity, rows = in_blocks(capacity), row_bucket(rows) if rows >= COMPILED_MIN_ROWS else rows
    total = bytes_per_position * (rows * capacity + sum(map(len, shared)))
    return total if cap is None else min(total, cap)


def running_cache(engine: RolloutEngine, shared: bool, longest_input: int, align: int) -> KVCache:
    """The empty cache a decoding run of `engine` holds its rows in: with inputs held once (`shared`), an
    `EvictingPrefixCache` under eviction (each row evicts on its own path, the prompt cut first; at most
    `longest_input` or the largest budget wide) or a `SharedPrefixCache` (whole `align`-position pages); a
    `QuantizedKVCache` under kv.quant (it copies every prompt: `RolloutEngine.share_prompts`); else a `KVCache`."""
    dec, kv = engine.decoder, engine.kv
    shape = (
        dec.num_layers,
        0,
        dec.num_kv_heads,
        dec.num_heads,
        dec.head_dim,
        0,
        kv.window,
        dec.dtype,
        dec.device,
    )
    extras = engine.evictor.method.extras if engine.evictor else ()
    if shared and engine.evictor is not None:
        return EvictingPrefixCache(*shape, extras=extras, width=min(kv.max_budget, longest_input))
    if kv.quantized:
        return QuantizedKVCache(*shape, extras=extras, quant=kv.quant)
    if shared:
        return SharedPrefixCache(*shape, extras=extras, align=align)
    return KVCache(*shape, extras=extras)
