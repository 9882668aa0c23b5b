"""DistillSparse v2's experiment report (experiments/distill_sparse.py) on hand-made parts: each goal's decision
rule (paired by seed, the interval or bound each rule names), so a result can only come from the committed rules."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import distill_sparse as X  # noqa: E402
from arms import part_goals  # noqa: E402
from study import write_with_goals  # noqa: E402

P5, POSITIONS, ACCURACY = list(X.GOALS)


def write_probes(parts: Path, rises: list[float], fewer: list[float]) -> None:
    (parts / "probe").mkdir(parents=True)
    for seed, (rise, d) in enumerate(zip(rises, fewer, strict=True)):
        probe = {"p5_on": 0.8 + rise, "p5_off": 0.8, "positions": 70 + d}
        (parts / "probe" / f"distill-seed{seed}.json").write_text(json.dumps(probe))
        (parts / "probe" / f"sparse-seed{seed}.json").write_text(json.dumps({"p5_on": 0.8, "positions": 70}))


@pytest.fixture
def parts(tmp_path, monkeypatch):
    monkeypatch.setattr(X, "PARTS", tmp_path)
    return tmp_path


def test_nothing_run_is_not_met(parts):
    assert all(not g["met"] and g["value"] is None for g in X.goals({}).values())


def test_p5_rise_needs_the_interval_above_zero_and_positions_a_lower_mean(parts):
    write_probes(parts, [0.05, 0.06, 0.04], [-8, -4, 2])
    out = X.goals({})
    assert all(type(g["met"]) is bool for g in out.values())  # JSON writes a numpy bool as the string "False"
    assert out[P5]["met"] and out[P5]["paired"]["df"] == 2 and out[P5]["paired"]["ci95"][0] > 0
    assert out[POSITIONS]["met"] and out[POSITIONS]["value"] == pytest.approx(-10 / 3)


def test_a_noisy_rise_is_not_met(tmp_path, monkeypatch):
    monkeypatch.setattr(X, "PARTS", tmp_path)
    write_probes(tmp_path, [0.10, -0.05, 0.02], [0, 0, 0])
    out = X.goals({})
    assert out[P5]["value"] > 0 and not out[P5]["met"]  # the mean rose, the interval spans 0
    assert not out[POSITIONS]["met"]  # the same positions: not fewer


def test_accuracy_is_non_inferiority_with_the_fixed_margin(parts):
    def runs(diffs):
        return {
            **{f"sparse-seed{s}": {"pass@1": 0.5} for s in X.SEEDS},
            **{f"distill-seed{s}": {"pass@1": 0.5 + d} for s, d in zip(X.SEEDS, diffs, strict=True)},
        }

    write_probes(parts, [0.0] * 3, [0] * 3)
    assert X.goals(runs([0.0, 0.005, -0.005]))[ACCURACY]["met"]
    assert not X.goals(runs([-0.03, -0.02, -0.04]))[ACCURACY]["met"]  # 3 points lower
    assert X.goals(runs([0.05, -0.06, 0.0]))[ACCURACY]["met"] is False  # too noisy to rule 3 points out


def test_rules_are_written_before_the_runs(tmp_path):
    import arms

    x = dataclasses.replace(X.EXPERIMENT, results_root=tmp_path)
    arms.write_rules(x)
    saved = json.loads(x.results.read_text())
    assert saved["rules"] == X.RULES and set(saved["goals"]) == set(X.GOALS)
    assert all(g["value"] is None and not g["met"] for g in saved["goals"].values())


def test_the_budget_grid_suits_block_topk():
    """Every budget the experiment calibrates over is one block_topk accepts (its first run stopped on a grid
    that started below the three always-read pages)."""
    from sparserl.eval.calibrate import budget_grid, candidate_kv_configs

    budgets = budget_grid(*X.GRID, X.KV["page_size"])
    assert len(candidate_kv_configs(X.settings(X.TAU), budgets)) == len(budgets)


def test_a_cached_part_carries_the_goals_mapping_and_reads_back_without_it(tmp_path):
    from sparse_parts import cached

    path = tmp_path / "part.json"
    assert cached(path, lambda: {"p5_on": 0.9}, part_goals(X.EXPERIMENT))["p5_on"] == 0.9
    assert set(json.loads(path.read_text())["goals"]) == set(X.GOALS)
    assert cached(path, lambda: pytest.fail("measured again"))["p5_on"] == 0.9
    assert "goals" not in cached(path, lambda: {})


def test_the_sparse_arm_trains_without_the_sweep_and_a_distill_run_takes_its_rate(parts, monkeypatch):
    (parts / "calibration").mkdir()
    (parts / "calibration" / "base.json").write_text("{}")
    (parts / "calibration" / "schedule.json").write_text("{}")
    monkeypatch.setitem(X.EXPERIMENT.arms, "distill", list(X.EXPERIMENT.arms["distill"]))
    monkeypatch.setattr(X.EXPERIMENT, "extra", [])
    trained, swept = [], []
    monkeypatch.setattr(X, "run", lambda x, only, script: trained.append((only, list(x.arms["distill"]))))
    monkeypatch.setattr(X, "in_own_process", lambda *args: None)
    monkeypatch.setattr(X, "sweep", lambda: swept.append(len(trained)) or 3e-5)
    X.train(["sparse-seed1", "sparse-seed0", "distill-seed2"])
    assert swept == [2]  # only when the distill run comes up, after the sparse ones
    assert [only for only, _ in trained] == [["sparse-seed1"], ["sparse-seed0"], ["distill-seed2"]]
    assert trained[-1][1] == ["distill.enable=true", "distill.lr=3e-05"]
    with pytest.raises(SystemExit, match="unknown run"):
        X.train(["distill-seed7"])


def test_a_result_file_holds_numpy_scalars_as_json_values(tmp_path):
    import numpy as np

    path = tmp_path / "r.json"
    write_with_goals(path, {"where": tmp_path}, {"g": {"value": np.float64(0.5), "met": np.bool_(False)}})
    saved = json.loads(path.read_text())
    assert saved["goals"]["g"] == {"value": 0.5, "met": False} and saved["where"] == str(tmp_path)
