"""How the rollout engine keeps its KV cache: dense, or evicted down to a per-sequence budget."""

from __future__ import annotations

from dataclasses import dataclass, field

EVICTION_METHODS = ("rkv", "snapkv", "h2o", "streaming_llm", "random")
KV_METHODS = ("dense", *EVICTION_METHODS)


@dataclass
class KVConfig:
    """KV-cache policy of the sampler. `method="dense"` keeps every position."""

    method: str = field(
        default="dense",
        metadata={"help": f"KV policy while sampling: one of {', '.join(KV_METHODS)}."},
    )
    budget: int = field(
        default=512,
        metadata={
            "help": "Retained positions per sequence, prompt included. Between compressions a sequence "
            "holds at most budget + interval - 1 positions per layer."
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

    def __post_init__(self) -> None:
        if self.method not in KV_METHODS:
            raise ValueError(f"kv.method={self.method!r} is unknown; choose one of {', '.join(KV_METHODS)}")
        if self.granularity not in ("per_head", "shared"):
            raise ValueError(f"kv.granularity={self.granularity!r} must be 'per_head' or 'shared'")
        if self.window < 1 or self.interval < 1:
            raise ValueError(f"kv.window ({self.window}) and kv.interval ({self.interval}) must be >= 1")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(
                f"kv.pool_kernel={self.pool_kernel} must be odd and >= 1 (it is centred on a slot)"
            )
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"kv.rkv_lambda={self.rkv_lambda} must be in [0, 1]")
        if self.n_sink < 0:
            raise ValueError(f"kv.n_sink={self.n_sink} must be >= 0")
        reserved = self.window + (self.n_sink if self.method == "streaming_llm" else 0)
        if self.method != "dense" and self.budget <= reserved:
            raise ValueError(
                f"kv.budget={self.budget} must exceed the always-kept positions "
                f"(window {self.window}"
                + (f" + {self.n_sink} sinks" if self.method == "streaming_llm" else "")
                + ")"
            )

    @property
    def evicting(self) -> bool:
        """True when the cache is cut back to `budget` during decoding."""
        return self.method in EVICTION_METHODS
