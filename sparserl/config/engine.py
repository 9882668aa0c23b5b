"""The engine section: how the rollout engine runs its decode step (compiled or eager), not what it computes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparserl.config.errors import ConfigError

COMPILE_SETTINGS = ("auto", True, False)


@dataclass
class EngineConfig:
    """How the rollout engine runs its decode step (not what it computes)."""

    compile: Any = field(
        default="auto",
        metadata={
            "help": "true, false or auto (the default): run the decode step through torch.compile with static "
            "shapes (the batch padded to a bucket of rows, 4, 8, 16, 32, ...; fewer than 4 rows step eagerly; "
            "attention over the whole preallocated cache), dense or evicting (R-KV, SnapKV, H2O, StreamingLLM, "
            "random; the cut stays eager) or block_topk (its page choice and attention stay eager islands), with "
            "kv.schedule and under rollout.kv_memory_cap. Each new "
            "shape (rows bucket, cache capacity in blocks of 128 or the eviction bound) compiles once, "
            "announced on the console: ~10-20 s on CPU for a tiny model, 30-40 CPU-s for SmolLM2-135M (~5 s "
            "when torch's compile cache holds it). auto compiles where it pays by measurement "
            "(docs/engine.md): a model of 50M parameters or more, not block_topk (1.08x slower compiled), a C++ "
            "compiler on CPU, and "
            "a run of at least 2000 decode steps (trainer.steps x rollout.max_new_tokens); else eager (tiny "
            "test models, short runs). Same tokens and log-probs as the eager step. `sparserl eval` and "
            "`sparserl rollout` run eagerly."
        },
    )

    def __post_init__(self) -> None:
        value = self.compile
        if isinstance(value, str):
            text = value.strip().lower()
            value = (
                True
                if text in ("true", "yes", "on", "1")
                else False
                if text in ("false", "no", "off", "0")
                else text
            )
        if value not in COMPILE_SETTINGS or (isinstance(value, int) and not isinstance(value, bool)):
            raise ConfigError(f"engine.compile={self.compile!r}: choose true, false or auto")
        self.compile = value
