"""engine.compile: the decode step through torch.compile with static shapes gives the eager step's samples."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_engine import BATCH_TOL, prompts_of
from test_trainer import tiny_cfg

from sparserl.config import ConfigError
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.models import tiny_model

needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile on CPU needs a C++ compiler",
)


def same_samples(a, b) -> float:
    """Max log-prob difference of two rollouts that must have drawn the same tokens."""
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    return max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(a, b, strict=True))


@needs_compiler
def test_compiled_step_equals_the_eager_one_and_sees_weight_updates():
    model, tok = tiny_model("llama", seed=0)
    prompts = prompts_of(tok)
    eager, compiled = RolloutEngine(model, tok), RolloutEngine(model, tok, compile=True)
    for update in range(2):
        a = eager.generate(prompts, n=3, max_new_tokens=20, seed=update)
        b = compiled.generate(prompts, n=3, max_new_tokens=20, seed=update)
        if update == 0:
            assert {s.finish_reason for s in a} == {"stop", "length"}  # rows finished mid-call, stayed masked
        assert same_samples(a, b) < BATCH_TOL
        assert b.stats["peak_kv_bytes"] >= a.stats["peak_kv_bytes"]  # the static cache is rounded up
        with torch.no_grad():  # an in-place update, as the optimizer makes: the next call must see it
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))


def test_compile_is_refused_for_sparse_rollouts(tmp_path: Path):
    model, tok = tiny_model("llama", seed=0)
    with pytest.raises(NotImplementedError, match="kv.method='snapkv'"):
        RolloutEngine(model, tok, KVConfig(method="snapkv", budget=16), compile=True)
    with pytest.raises(ConfigError, match="engine.compile=true runs dense rollouts only"):
        tiny_cfg(tmp_path, "engine.compile=true", "algo.preset=sparse-rl", "kv.method=snapkv")
