"""The reports of issue 35's and 36's experiments (experiments/sapo.py, reuse.py) on hand-made runs: the paired
comparisons and goals follow the rules written before the runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import reuse  # noqa: E402
import sapo  # noqa: E402


def test_sapo_compares_each_node_paired_by_seed():
    runs = {}
    for s in (0, 1, 2):
        for node in (0, 1):
            runs[f"shared_node{node}-seed{s}"] = {"pass@1": 0.3 + 0.01 * s, "reward/mean": 0.5}
            runs[f"local_node{node}-seed{s}"] = {"pass@1": 0.2 + 0.01 * s, "reward/mean": 0.5}
    comp = sapo.comparison(runs)
    assert comp["node0 pass@1: shared - local"]["mean"] == pytest.approx(0.1)
    assert comp["node1 reward/mean: shared - local"]["df"] == 2


def run(times: list[float], acc: float) -> dict:
    return {"curves": {"time/rollout": times}, "pass@k": [acc]}


def test_reuse_goals_follow_their_rules():
    runs = {}
    for s, (g, a) in enumerate([(0.50, 0.52), (0.40, 0.43), (0.45, 0.44)]):
        runs[f"grpo-seed{s}"] = run([9.0] * 4 + [3.0] * 20, g)  # epochs 2-6: 60 s
        runs[f"spec-seed{s}"] = run([9.0] * 4 + [1.5] * 20, a)  # 30 s: 2x faster
    got = reuse.with_eval_means(reuse.goals)(runs)
    speed, quality = got[reuse.SPEED], got[reuse.QUALITY]
    assert speed["value"] == pytest.approx(2.0) and speed["met"]
    assert quality["gap"] == pytest.approx(abs(0.4633333 - 0.45), abs=1e-6) and quality["met"]
    assert reuse.goals({})[reuse.SPEED]["met"] is False
