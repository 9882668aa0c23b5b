"""How the rollout engine keeps and reads its KV cache: dense, evicted down to a per-sequence budget, or whole
with each decode step reading only some pages (block-sparse attention). kv.method names one of the registered
eviction methods (EVICTION_METHODS) or page selectors (SELECTORS); those modules import this one for typing
only, so a method is one file."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparserl.engine.compression import EVICTION_METHODS
from sparserl.engine.kv_quant import KV_QUANTS
from sparserl.engine.schedule import MAX_LENGTH, BudgetSchedule, parse_schedule
from sparserl.engine.sparse_attention import SELECTORS
from sparserl.engine.sparse_attention.base import ALWAYS_READ_PAGES
from sparserl.errors import UserError

DENSE = "dense"  # the kv.method that keeps and reads every position: no registered class, the absence of one


def kv_methods() -> tuple[str, ...]:
    """Every kv.method value: dense, the registered eviction methods, then the registered page selectors."""
    return (DENSE, *EVICTION_METHODS, *SELECTORS)


@dataclass
class KVConfig:
    """KV-cache policy of the sampler. `method="dense"` keeps and reads every position."""

    method: str = field(
        default=DENSE,
        metadata={
            "help": f"KV policy while sampling: one of {', '.join(kv_methods())}. Eviction methods "
            f"({', '.join(EVICTION_METHODS)}) cut the cache to the budget; block-sparse ones "
            f"({', '.join(SELECTORS)}) keep it whole and read the budget's worth of pages per step."
        },
    )
    budget: int = field(
        default=512,
        metadata={
            "help": "Per-sequence budget, prompt included. Eviction: retained positions (between compressions "
            "a sequence holds at most budget + interval - 1 per layer). block_topk: positions read per step "
            "(page_size x pages, the first and 2 most recent pages included). kv.schedule replaces it."
        },
    )
    schedule: Any = field(
        default=None,
        metadata={
            "help": "Length schedule replacing kv.budget: a table [[from_length, budget], ...] (first bin "
            "from 0, starts increasing, budgets non-decreasing), inline (kv.schedule=[[0,256],[512,384]]) or "
            "a JSON/YAML file holding it (or a mapping with a 'schedule' key). Each sequence's budget is "
            "re-read at every decode step from its current length (prompt + generated); null: none."
        },
    )
    window: int = field(
        default=8,
        metadata={"help": "The last `window` positions are always kept; their queries score the rest."},
    )
    interval: int = field(
        default=128, metadata={"help": "Decode steps between two compressions of an over-budget sequence."}
    )
    granularity: str = field(
        default="per_head",
        metadata={
            "help": "'per_head': each layer and KV head keeps its own set (the original methods); "
            "'shared': one set per sequence, chosen at layer 0 from head-summed scores, used by all layers."
        },
    )
    page_size: int = field(
        default=16,
        metadata={"help": "block_topk: tokens per page; a full page is summarised by the mean of its keys."},
    )
    dense_layers: list[int] = field(
        default_factory=lambda: [0, 1],
        metadata={"help": "block_topk: layers that always read every position (comma-separated)."},
    )
    rkv_lambda: float = field(
        default=0.1,
        metadata={"help": "R-KV: weight of importance versus redundancy (score = l*I - (1-l)*R)."},
    )
    rkv_similarity_threshold: float = field(
        default=0.5,
        metadata={"help": "R-KV: cosine similarity above which a key counts as a near-duplicate."},
    )
    pool_kernel: int = field(
        default=7, metadata={"help": "SnapKV / R-KV: max-pool kernel smoothing the attention scores."}
    )
    n_sink: int = field(default=4, metadata={"help": "StreamingLLM: first positions always kept (sinks)."})
    seed: int = field(default=0, metadata={"help": "Seed of the `random` control method."})
    quant: str = field(
        default="none",
        metadata={
            "help": f"How the sampler's cache stores keys and values: one of {', '.join(KV_QUANTS)}. int8 or fp8 "
            "(e4m3) codes with one float32 scale per position and KV head (about 0.27x the bytes of float32 at "
            "head_dim 64), dequantized where a decode step reads them; composes with every kv.method. Prefill "
            "stays exact; a quantized cache copies each prompt into its rows instead of holding it once."
        },
    )

    def __post_init__(self) -> None:
        if self.method not in kv_methods():
            raise UserError(f"kv.method={self.method!r} is unknown; choose one of {', '.join(kv_methods())}")
        if self.quant not in KV_QUANTS:
            raise UserError(f"kv.quant={self.quant!r} is unknown; choose one of {', '.join(KV_QUANTS)}")
        if self.granularity not in ("per_head", "shared"):
            raise UserError(f"kv.granularity={self.granularity!r} must be 'per_head' or 'shared'")
        if self.window < 1 or self.interval < 1:
            raise UserError(f"kv.window ({self.window}) and kv.interval ({self.interval}) must be >= 1")
        for key in ("budget", "window", "interval", "page_size", "n_sink", "pool_kernel"):
            if getattr(self, key) > MAX_LENGTH:
                raise UserError(
                    f"kv.{key}={getattr(self, key)} is beyond any context: at most {MAX_LENGTH:,}"
                )
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise UserError(
                f"kv.pool_kernel={self.pool_kernel} must be odd and >= 1 (it is centred on a slot)"
            )
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise UserError(f"kv.rkv_lambda={self.rkv_lambda} must be in [0, 1]")
        if self.n_sink < 0:
            raise UserError(f"kv.n_sink={self.n_sink} must be >= 0")
        if self.page_size < 1:
            raise UserError(f"kv.page_size={self.page_size} must be >= 1")
        if any(layer < 0 for layer in self.dense_layers):
            raise UserError(f"kv.dense_layers={self.dense_layers} must be layer indices >= 0")
        self.schedule = parse_schedule(self.schedule, method=self.method)
        if self.method != DENSE:
            for name, budget in self._budgets():
                self._check_budget(name, budget)

    def _budgets(self) -> list[tuple[str, int]]:
        """(what to call it in an error, budget) for kv.budget, or for every bin of kv.schedule."""
        if self.schedule is None:
            return [(f"kv.budget={self.budget}", self.budget)]
        return [
            (f"kv.schedule bin {i} (from length {start}): budget {budget}", budget)
            for i, (start, budget) in enumerate(self.schedule)
        ]

    def _check_budget(self, name: str, budget: int) -> None:
        """A budget must exceed what the method always keeps (eviction) or fill whole pages, at least the
        always-read ones (block_topk)."""
        if self.sparse_attention:
            if budget % self.page_size:
                raise UserError(
                    f"{name} is not a multiple of kv.page_size={self.page_size} (whole pages are read)"
                )
            if budget < ALWAYS_READ_PAGES * self.page_size:
                raise UserError(
                    f"{name} is below the always-read pages: the first and the 2 most recent, "
                    f"{ALWAYS_READ_PAGES} x kv.page_size={self.page_size} = {ALWAYS_READ_PAGES * self.page_size}"
                )
            return
        sinks = EVICTION_METHODS[self.method].keeps_sinks
        if budget <= self.window + (self.n_sink if sinks else 0):
            raise UserError(
                f"{name} must exceed the always-kept positions (window {self.window}"
                + (f" + {self.n_sink} sinks" if sinks else "")
                + ")"
            )

    @property
    def evicting(self) -> bool:
        """True when the cache is cut back to a budget during decoding."""
        return self.method in EVICTION_METHODS

    @property
    def sparse_attention(self) -> bool:
        """True when the cache is kept whole and each decode step reads only some of its pages."""
        return self.method in SELECTORS

    @property
    def quantized(self) -> bool:
        """True when the cache holds quantized keys and values."""
        return self.quant != "none"

    @property
    def sparse(self) -> bool:
        """True when sampling differs from dense attention (evicting, reading only some pages, or reading a
        quantized cache)."""
        return self.evicting or self.sparse_attention or self.quantized

    @property
    def short_name(self) -> str:
        """kv.method, then kv.quant after a dash when quantized ('rkv-int8'): for directory names."""
        return f"{self.method}-{self.quant}" if self.quantized else self.method

    def describe(self) -> str:
        """The cache in words for headers and tables: 'dense', 'sparse rkv, budget 80', or the schedule when
        kv.schedule replaces kv.budget (the budget is then unused and not shown); then ', int8 KV' when
        quantized."""
        if self.method == DENSE:
            words = DENSE
        elif self.schedule:
            budgets = [b for _, b in self.schedule]
            span = f"{budgets[0]}" if len(set(budgets)) == 1 else f"{min(budgets)}-{max(budgets)}"
            words = f"sparse {self.method}, schedule of {len(budgets)} bins (budgets {span})"
        else:
            words = f"sparse {self.method}, budget {self.budget}"
        return f"{words}, {self.quant} KV" if self.quantized else words

    @property
    def budget_schedule(self) -> BudgetSchedule:
        """The budget as a function of length: kv.schedule, or kv.budget at every length."""
        if self.schedule is None:
            return BudgetSchedule.constant(self.budget)
        return BudgetSchedule.from_table(self.schedule)

    @property
    def max_budget(self) -> int:
        """The largest budget any sequence gets (an evicting cache's bound is this + interval - 1)."""
        return self.budget_schedule.largest
