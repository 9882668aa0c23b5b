"""The engine on a CUDA GPU (skipped without one; `pytest -m cuda`): the same checks as on CPU, on the module
path (no packed copy) and the packed bfloat16 path, eager and compiled."""

from __future__ import annotations

import pytest
import torch
from test_bf16 import BF16_TOL
from test_compile import same_samples
from test_engine import AGREE_TOL, max_gap, prompts_of, score_rollouts

from sparserl.engine import RolloutEngine
from sparserl.models import tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def tiny_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 tolerance is float32's, not TF32's
    model, tok = tiny_model("llama", seed=0)
    return model.cuda(), tok


def test_cuda_sampler_matches_the_scorer(tiny_cuda):
    model, tok = tiny_cuda
    prompts = prompts_of(tok)
    out = RolloutEngine(model, tok).generate(prompts, n=3, max_new_tokens=20, seed=0)
    assert max_gap(out, score_rollouts(model, prompts, out)) < AGREE_TOL


def test_cuda_bf16_rollouts_within_the_bf16_tolerance(tiny_cuda):
    model, tok = tiny_cuda
    prompts = prompts_of(tok)
    out = RolloutEngine(model, tok, dtype=torch.bfloat16).generate(prompts, n=3, max_new_tokens=20, seed=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert max_gap(out, score_rollouts(model, prompts, out)) < BF16_TOL


def test_cuda_compiled_step_equals_the_eager_one(tiny_cuda):
    model, tok = tiny_cuda
    prompts = prompts_of(tok)
    eager = RolloutEngine(model, tok).generate(prompts, n=3, max_new_tokens=20, seed=0)
    compiled = RolloutEngine(model, tok, compile=True).generate(prompts, n=3, max_new_tokens=20, seed=0)
    assert same_samples(eager, compiled) < AGREE_TOL
