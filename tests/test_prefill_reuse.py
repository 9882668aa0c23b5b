"""A prompt's prefills reused across a calibration's budgets (engine/prefill_reuse.py): the same numbers bit for
bit as measuring each unit on its own, the kept prefill never changed by its users, and no reuse with grad or
outside the scope."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_calibrate import prompts, tiny

from sparserl.engine.kv_config import EVICTION_METHODS
from sparserl.engine.prefill_reuse import reused, reusing_prefills
from sparserl.engine.rollout import RolloutEngine
from sparserl.eval.calibrate import CalibrationSettings, measure_unit


def settings(method: str) -> CalibrationSettings:
    """Two samples of 24 tokens after a prompt of ~60 tokens, exact alpha: eviction cuts the prompt itself."""
    options = (
        {"page_size": 4, "dense_layers": [0]} if method == "block_topk" else {"window": 4, "interval": 4}
    )
    return CalibrationSettings(method, options, n=2, max_new_tokens=24, bin_width=16, ignore_eos=True)


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("positions", "topk", "exact", "sequences"))


@pytest.mark.parametrize("method", ["block_topk", *EVICTION_METHODS])
def test_units_sharing_a_prompt_are_the_ones_measured_alone(method, monkeypatch: pytest.MonkeyPatch):
    """Every budget, and the first budget again, inside one scope gives the units measured one by one outside it,
    with one sampler prefill instead of three: the kept prefill (cut and summarised after it is handed out) and
    the scorer's prompt pass (extended by each call's completions) are handed out as copies."""
    model, tok = tiny()
    prefills = []
    real = RolloutEngine._prefill
    monkeypatch.setattr(RolloutEngine, "_prefill", lambda self, *a: prefills.append(1) or real(self, *a))
    s = settings(method)
    prompt = prompts(25)[0]
    assert len(prompt) > 40  # longer than the tight budget: an evicting method cuts the prefilled prompt
    budgets = [12, 24, 12]
    alone = [measure_unit(model, tok, prompt, s.kv(budget=b), s) for b in budgets]
    assert len(prefills) == 3
    with reusing_prefills():
        shared = [measure_unit(model, tok, prompt, s.kv(budget=b), s) for b in budgets]
    assert len(prefills) == 4
    assert all(same(a, b) for a, b in zip(alone, shared, strict=True))
    assert not same(alone[0], alone[1])  # the budgets differ, so a unit handed the wrong prefill would show


def test_reuse_only_inside_the_scope_and_without_grad():
    calls = []

    def compute():
        calls.append(1)
        return torch.ones(2)

    with torch.no_grad():
        reused("k", compute, torch.clone)
        with reusing_prefills():
            first = reused("k", compute, torch.clone)
            first += 1  # the caller's change never reaches the kept value
            assert torch.equal(reused("k", compute, torch.clone), torch.ones(2))
            reused("other", compute, torch.clone)
            with torch.enable_grad():
                reused("k", compute, torch.clone)  # a learner's pass: computed again
        reused("k", compute, torch.clone)
    assert len(calls) == 5  # outside, first inside, "other", with grad, outside again


def test_a_scope_inside_another_is_the_outer_one():
    """The frontier's speed table opens a scope per length around time_decode_steps, which opens its own."""
    calls = []
    with torch.no_grad(), reusing_prefills():
        reused("k", lambda: calls.append(1) or torch.ones(1), torch.clone)
        with reusing_prefills():
            reused("k", lambda: calls.append(1) or torch.ones(1), torch.clone)
        reused("k", lambda: calls.append(1) or torch.ones(1), torch.clone)
    assert len(calls) == 1


def test_the_benchmark_smoke_run_finds_the_units_identical(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import prefill_reuse

    out = prefill_reuse.main(["--quick", "--out", str(tmp_path / "r.json")])
    assert out["units_identical"] and set(out["cpu_s"]) == {"alone", "shared"}
    assert json.loads((tmp_path / "r.json").read_text())["goals"] == {}
