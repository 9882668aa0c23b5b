"""The rollout engine a training run samples with, from its TrainConfig: the KV policy (none when the run is
dense), the compute dtype (`model.dtype`) and `engine.compile` resolved for the run's decode steps. The local
backend builds its engine with these settings, each Ray rollout worker its own, and the trainer its engine for
held-out evaluation and the model-backed judges: one rule, so they all sample alike."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparserl.engine.rollout import resolve_compile


def engine_settings(cfg: Any, model: nn.Module) -> tuple[dict[str, Any], str | None]:
    """`RolloutEngine(model, tokenizer, **settings)`'s settings for the run `cfg`, and the note the run says
    about them (auto's choice when it compiles the decode step; else None)."""
    kv = cfg.kv if cfg.sparse else None
    steps = cfg.trainer.steps * cfg.rollout.max_new_tokens
    compiled, why = resolve_compile(cfg.engine.compile, model, kv, steps)
    note = why if cfg.engine.compile == "auto" and compiled else None
    return {"kv": kv, "dtype": getattr(torch, cfg.model.dtype), "compile": compiled}, note
