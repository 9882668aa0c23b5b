"""The cost model: exact FLOPs and bytes of a rollout, decode step by decode step, for dense, eviction and
block-sparse (Sparrow) KV caches.

Effective FLOPs = FLOPs + I x bytes, with I the hardware's FLOPs per byte (`sparserl.cost.probe`). A rollout is
one GRPO group as the engine runs it: the prompt is prefilled once (dense, the same for every method; the last
prompt position yields the first token), its KV copied to the n samples, then `output_len - 1` decode steps,
each feeding one token per sample at context `prompt_len + s` (s = 1, 2, ...). Per step the batch reads the
weights once and multiplies them for every sample; each sample writes one position and reads the positions its
method attends to in every layer. EOS is ignored: every sample reaches `output_len`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch

from sparserl.cost.shape import CostInputError, ModelShape
from sparserl.engine.kv_config import KVConfig
from sparserl.registry import Registry

CENTROID_BYTES = 4  # block_topk keeps its page centroids in float32 whatever the model's dtype
SCALE_BYTES = 4  # a quantized cache's float32 scale per position, layer, KV head, key or value
DEQUANT_FLOPS = 2  # a quantized cache's code read: converted, then multiplied by its scale


@dataclass(frozen=True)
class Rollout:
    """One GRPO group: `n` samples of one `prompt_len`-token prompt, each generating `output_len` tokens."""

    prompt_len: int
    output_len: int
    n: int

    def __post_init__(self) -> None:
        for key in ("prompt_len", "output_len", "n"):
            if getattr(self, key) < 1:
                raise CostInputError(f"{key}={getattr(self, key)} must be >= 1")

    @property
    def contexts(self) -> range:
        """Positions a sample holds at each decode step once the step's token is written (dense)."""
        return range(self.prompt_len + 1, self.prompt_len + self.output_len)


@dataclass
class Cost:
    """FLOPs and bytes moved, by where they come from."""

    weight_flops: int = 0  # 2 x weights per token
    attention_flops: int = 0  # q.k and p.v over the positions read
    overhead_flops: int = 0  # page scoring and centroids (block_topk)
    weight_bytes: int = 0  # weights read once per step for the batch, plus the embedding rows
    kv_read_bytes: int = 0  # keys and values of the positions read
    kv_write_bytes: int = 0  # the new position of every sample
    overhead_bytes: int = 0  # centroid reads and writes (block_topk), the copies of a cut (eviction)

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def flops(self) -> int:
        return self.weight_flops + self.attention_flops + self.overhead_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.overhead_bytes

    def effective(self, intensity: float) -> float:
        """Effective FLOPs: compute + I x bytes moved, a time in units of the hardware's FLOP."""
        return self.flops + intensity * self.bytes


# One decode step of one sample: (positions held after the step's write, positions read summed over layers,
# method overhead FLOPs, method overhead bytes).
Step = tuple[int, int, int, int]


def budget_label(kv: KVConfig) -> str:
    """'512' for a fixed budget, '512@0,1024@2000' for a schedule."""
    if kv.schedule is None:
        return str(kv.budget)
    return ",".join(f"{budget}@{start}" for start, budget in kv.schedule)


class KVMethod(ABC):
    """How one rollout method holds and reads the KV cache. Subclasses stay small: the positions read per
    step, the positions held, and the bookkeeping that costs extra."""

    def __init__(self, shape: ModelShape, rollout: Rollout, kv: KVConfig):
        self.shape, self.rollout, self.kv = shape, rollout, kv
        self.position_bytes = kv_position_bytes(shape, kv)

    def budgets(self) -> list[int]:
        """The budget of each decode step, looked up from the sample's length once the step's token is
        written, as the engine does."""
        contexts = torch.tensor(self.rollout.contexts, dtype=torch.long)
        return self.kv.budget_schedule.budget(contexts).tolist()

    @abstractmethod
    def decode(self) -> Iterator[Step]:
        """Every decode step of one sample, in order."""

    @abstractmethod
    def held_positions(self) -> int:
        """Positions the engine allocates per sample (the memory a sample is charged)."""

    def budget_label(self) -> str:
        return budget_label(self.kv)

    def prefill_kept(self) -> int:
        """Positions a prompt keeps after prefill (and copies to each sample)."""
        return self.rollout.prompt_len

    def prefill_overhead(self) -> tuple[int, int]:
        """(FLOPs, bytes) the method adds to the prefill, once per prompt."""
        return 0, 0

    def extra_bytes_per_sequence(self) -> int:
        """Memory per sample beyond its keys and values (block_topk's centroids)."""
        return 0


METHODS: Registry[type[KVMethod]] = Registry("cost model")


@METHODS.register("dense")
class Dense(KVMethod):
    """Every layer reads every position; the cache holds prompt + output positions."""

    def decode(self) -> Iterator[Step]:
        for context in self.rollout.contexts:
            yield context, self.shape.layers * context, 0, 0

    def held_positions(self) -> int:
        return self.rollout.prompt_len + self.rollout.output_len

    def budget_label(self) -> str:
        return "-"


@METHODS.register("eviction")
class Eviction(KVMethod):
    """KV eviction as the engine runs it (docs/eviction.md): a prompt over its budget is cut to it after
    prefill; before every `interval`-th decode step a sample holding `budget` or more positions is cut to
    `budget - 1`, so it holds `budget` after the write. Between cuts it grows by one position per step. A cut
    copies the kept keys and values (read + write); its scoring (0.4-5.4% of decode, measured) is not modelled,
    so every eviction method costs the same here."""

    def cut_bytes(self, kept: int) -> int:
        return 2 * kept * self.position_bytes

    def prefill_kept(self) -> int:
        prompt = self.rollout.prompt_len
        return min(prompt, self.kv.budget_schedule.budget(torch.tensor([prompt])).item())

    def prefill_overhead(self) -> tuple[int, int]:
        kept = self.prefill_kept()
        return 0, (self.cut_bytes(kept) if kept < self.rollout.prompt_len else 0)

    def decode(self) -> Iterator[Step]:
        held, interval = self.prefill_kept(), self.kv.interval
        for s, budget in enumerate(self.budgets(), start=1):
            moved = 0
            if s % interval == 0 and held >= budget:
                held, moved = budget - 1, self.cut_bytes(budget - 1)
            held += 1
            yield held, self.shape.layers * held, 0, moved

    def held_positions(self) -> int:
        bound = self.kv.max_budget + self.kv.interval - 1
        return min(bound, self.rollout.prompt_len + self.rollout.output_len)


@METHODS.register("block_sparse")
class BlockSparse(KVMethod):
    """Sparrow's block-sparse attention as the engine runs it (`kv.method=block_topk`): the whole cache is
    kept. Outside `kv.dense_layers`, a step whose pages (the partial current one included) exceed the budget's
    reads only budget // page_size pages, the current partial page counting as one (its empty slots are
    computed and masked): it scores every page per KV head (the query mean, then one dot product per float32
    centroid read) and gathers the chosen pages into a buffer (one read and one write of them) that attention
    reads. A page that fills costs the mean of its keys and a centroid write; prefill summarises the prompt's
    full pages."""

    def __init__(self, shape: ModelShape, rollout: Rollout, kv: KVConfig):
        super().__init__(shape, rollout, kv)
        outside = [layer for layer in kv.dense_layers if layer >= shape.layers]
        if outside:
            raise CostInputError(
                f"kv.dense_layers={kv.dense_layers} names layer {outside[0]}, but {shape.name} has "
                f"{shape.layers} layers (0..{shape.layers - 1})"
            )
        self.dense_layers = len(set(kv.dense_layers))
        self.sparse_layers = shape.layers - self.dense_layers
        # one vector per KV head of every sparse layer: a query mean, a centroid
        self.head_slice = self.sparse_layers * shape.kv_heads * shape.head_dim

    def centroid_cost(self, pages: int) -> tuple[int, int]:
        """(FLOPs, bytes) of summarising `pages` full pages: read their keys, sum them, write the means."""
        page, b = self.kv.page_size, self.shape.dtype_bytes
        return self.head_slice * page * pages, self.head_slice * (page * b + CENTROID_BYTES) * pages

    def prefill_overhead(self) -> tuple[int, int]:
        return self.centroid_cost(self.rollout.prompt_len // self.kv.page_size)

    def decode(self) -> Iterator[Step]:
        page, shape = self.kv.page_size, self.shape
        gather = self.position_bytes // shape.layers  # K + V of a position in one layer
        filled_flops, filled_bytes = self.centroid_cost(1)
        for context, budget in zip(self.rollout.contexts, self.budgets(), strict=True):
            pages, budget_pages = -(-context // page), budget // page
            read, flops, moved = context, 0, 0
            if pages > budget_pages:
                read = budget_pages * page
                flops = self.head_slice * (shape.group + 2 * pages)
                moved = self.head_slice * pages * CENTROID_BYTES + 2 * self.sparse_layers * read * gather
            if context % page == 0:
                flops, moved = flops + filled_flops, moved + filled_bytes
            yield context, self.dense_layers * context + self.sparse_layers * read, flops, moved

    def held_positions(self) -> int:
        return self.rollout.prompt_len + self.rollout.output_len

    def extra_bytes_per_sequence(self) -> int:
        pages = -(-self.held_positions() // self.kv.page_size)
        return pages * self.head_slice * CENTROID_BYTES


def cost_model(kv: KVConfig) -> type[KVMethod]:
    """The cost model of kv.method's kind: every registered eviction method runs through the engine's Evictor,
    every registered page selector reads pages as block_topk does, so the kind decides the cost."""
    return METHODS.lookup("eviction" if kv.evicting else "block_sparse" if kv.sparse_attention else "dense")


@dataclass
class Estimate:
    """The predicted cost of one method's rollout."""

    method: str
    budget: str
    prefill: Cost
    decode: Cost
    decode_steps: int
    mean_positions_read: float  # per layer, per sample and decode step
    positions_held: int  # allocated per sample
    bytes_per_sequence: int  # KV (+ centroids) per sample

    @property
    def total(self) -> Cost:
        return self.prefill + self.decode

    def sequences_fitting(self, mem_cap: int) -> int:
        """How many samples' caches fit in `mem_cap` bytes of KV memory."""
        return mem_cap // self.bytes_per_sequence


def kv_position_bytes(shape: ModelShape, kv: KVConfig) -> int:
    """Bytes one held position costs across all layers, as the engine's cache: the compute dtype's, or under
    kv.quant one byte per element and a float32 scale per layer, KV head and key or value."""
    if not kv.quantized:
        return shape.kv_bytes_per_position
    return 2 * shape.layers * shape.kv_heads * (shape.head_dim + SCALE_BYTES)


def prefill_cost(shape: ModelShape, rollout: Rollout, kept: int, position: int) -> Cost:
    """The dense prefill of one prompt (causal attention, one logits row), then copying the `kept` positions
    (`position` bytes each in the cache) to each of the n samples."""
    prompt, b = rollout.prompt_len, shape.dtype_bytes
    return Cost(
        weight_flops=2 * shape.layers * shape.layer_params * prompt + 2 * shape.vocab * shape.hidden,
        attention_flops=4 * shape.heads * shape.head_dim * shape.layers * prompt * (prompt + 1) // 2,
        weight_bytes=shape.token_params * b + prompt * shape.hidden * b,
        kv_read_bytes=(prompt + kept) * shape.kv_bytes_per_position,
        kv_write_bytes=prompt * shape.kv_bytes_per_position + rollout.n * kept * position,
    )


def estimate(shape: ModelShape, rollout: Rollout, kv: KVConfig) -> Estimate:
    """Sum the exact per-step costs of a rollout under the KV policy `kv` (no asymptotics)."""
    method = cost_model(kv)(shape, rollout, kv)
    n, b, steps = rollout.n, shape.dtype_bytes, rollout.output_len - 1
    read = extra_flops = extra_bytes = 0
    for _, layer_positions, flops, moved in method.decode():
        read, extra_flops, extra_bytes = read + layer_positions, extra_flops + flops, extra_bytes + moved
    if kv.quantized:  # every code read is converted and scaled: 2 FLOPs per key or value element
        extra_flops += DEQUANT_FLOPS * 2 * shape.kv_heads * shape.head_dim * read
    decode = Cost(
        weight_flops=2 * shape.token_params * n * steps,
        attention_flops=4 * shape.heads * shape.head_dim * read * n,
        overhead_flops=extra_flops * n,
        weight_bytes=(shape.token_params + n * shape.hidden) * b * steps,
        kv_read_bytes=method.position_bytes // shape.layers * read * n,
        kv_write_bytes=method.position_bytes * n * steps,
        overhead_bytes=extra_bytes * n,
    )
    prefill_flops, prefill_bytes = method.prefill_overhead()
    prefill = prefill_cost(shape, rollout, method.prefill_kept(), method.position_bytes) + Cost(
        overhead_flops=prefill_flops, overhead_bytes=prefill_bytes
    )
    held = method.held_positions()
    return Estimate(
        method=kv.method if not kv.quantized else f"{kv.method}+{kv.quant}",
        budget=method.budget_label(),
        prefill=prefill,
        decode=decode,
        decode_steps=steps,
        mean_positions_read=read / (steps * shape.layers) if steps else 0.0,
        positions_held=held,
        bytes_per_sequence=held * method.position_bytes + method.extra_bytes_per_sequence(),
    )
