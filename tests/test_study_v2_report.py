"""Study v2's report logic that decides goals: the collapse rule, per-step seed statistics, and the four goals."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
report = importlib.import_module(
    "study_v2_report"
)  # a broken import fails the tests rather than skipping them


def run_curves(reward: list[float], length: list[float] | None = None) -> dict[str, list]:
    return {"reward": reward, "length": length or [40.0] * len(reward)}


def test_collapse_rule_reward_length_and_short_runs():
    steady = [0.5] * 20
    assert not report.collapsed(run_curves(steady))
    assert report.collapsed(run_curves([0.6] * 15 + [0.1] * 5))  # last 5 below half the best 5-step mean
    assert report.collapsed(run_curves(steady, [60.0] * 15 + [20.0] * 5))  # length halves
    assert not report.collapsed(run_curves([0.6] * 5 + [0.0] * 4))  # fewer than 2 windows: no verdict


def test_across_seeds_skips_missing_steps_and_none():
    stats = report.across_seeds([[1.0, 2.0, None], [3.0]])
    assert stats["mean"] == [2.0, 2.0, None]
    assert stats["sd"][0] == pytest.approx(2**0.5)
    assert stats["sd"][1] == 0.0


def test_last_window_shows_the_spread_only_over_several_seeds():
    curve = {"reward": report.across_seeds([[0.0] * 5 + [0.4] * 5, [0.0] * 5 + [0.6] * 5])}
    assert report.last(curve, "reward", seeds=2) == "0.500 +- 0.141"
    assert report.last(curve, "reward", seeds=1) == "0.500"  # one seed: no "+- 0.000" that reads as certainty
    assert report.last({"kl": {"mean": [None] * 5, "sd": [None] * 5}}, "kl", seeds=2) == "-"


def test_heldout_cell_shows_the_spread_only_over_several_seeds():
    assert report.heldout_cell({"mean": 0.5, "sd": 0.1, "n": 3, "stderr": 0.06}) == "0.500 +- 0.100 (0.060)"
    # the starting model, or one seed: no spread
    assert report.heldout_cell({"mean": 0.5, "stderr": 0.03}) == "0.500 (0.030)"


def arm(dense: float, rkv: float, stderr: float, collapsed: bool = False, saved: float | None = None) -> dict:
    return {
        "seeds": [0, 1, 2],
        "dense": {"mean": dense, "stderr": stderr},
        "rkv": {"mean": rkv, "stderr": stderr},
        "collapsed": {0: collapsed},
        "train_kv_saved_fraction": saved,
    }


BASE = {"dense": {"accuracy": 0.70, "stderr": 0.03}}


def test_goals_unmeasured_until_their_arms_finish():
    out = report.goals({"dense": arm(0.9, 0.15, 0.02)}, BASE, {})
    assert all(not g["met"] and g["value"] is None and "reason" in g for g in out.values())


def test_sparse_rl_goals_met_and_not_met():
    dense = arm(0.90, 0.15, 0.02)
    good = report.goals({"dense": dense, "sparse-rl-rkv": arm(0.895, 0.20, 0.02, saved=0.79)}, BASE, {})
    assert good["sparse_rl_keeps_dense_gain"]["met"]  # 0.195 / 0.2 = 0.975 of the gain
    assert good["sparse_rl_keeps_dense_gain"]["seeds"] == {"sparse-rl-rkv": [0, 1, 2], "dense": [0, 1, 2]}
    assert good["sparse_rl_model_under_sparse_inference"]["met"]
    too_little_saved = report.goals(
        {"dense": dense, "sparse-rl-rkv": arm(0.9, 0.2, 0.02, saved=0.3)}, BASE, {}
    )
    assert not too_little_saved["sparse_rl_keeps_dense_gain"]["met"]
    worse = report.goals({"dense": dense, "sparse-rl-rkv": arm(0.80, 0.10, 0.02, saved=0.79)}, BASE, {})
    assert worse["sparse_rl_keeps_dense_gain"]["value"] == pytest.approx(0.5)
    assert not worse["sparse_rl_keeps_dense_gain"]["met"]
    assert not worse["sparse_rl_model_under_sparse_inference"]["met"]


@pytest.mark.parametrize(
    ("naive_dense", "collapsed", "srl_collapsed", "met"),
    [
        (0.70, False, False, True),  # gap 0.15 > 2 x 0.028
        (0.82, False, False, False),  # gap 0.03 is not
        (0.82, True, False, True),  # naive collapsed where Sparse-RL of the same seed held
        (0.82, True, True, False),  # both collapsed: naive did not degrade relative to Sparse-RL
    ],
)
def test_naive_sparse_degrades_by_gap_or_collapse(naive_dense, collapsed, srl_collapsed, met):
    arms = {"sparse-rl-rkv": arm(0.85, 0.2, 0.02, srl_collapsed),
            "naive-sparse-rkv": arm(naive_dense, 0.2, 0.02, collapsed)}  # fmt: skip
    goal = report.goals(arms, BASE, {})["naive_sparse_degrades"]
    assert goal["met"] is met
    assert goal["met_by_any_naive_collapse"] is (met or collapsed)


@pytest.mark.parametrize(
    ("tau086", "tau075", "speedup", "met"),
    [(0.89, 0.60, 1.2, True), (0.80, 0.60, 1.2, False), (0.89, 0.89, 1.2, False), (0.89, 0.60, 0.9, False)],
)
def test_sparrow_goal_needs_all_three_parts(tau086, tau075, speedup, met):
    arms = {"dense": arm(0.90, 0.15, 0.02), "sparrow-tau086": arm(tau086, 0.1, 0.02),
            "sparrow-tau075": arm(tau075, 0.1, 0.02)}  # fmt: skip
    speed = {"dense": {"tokens_per_cpu_s": 10.0}, "schedule_tau086": {"tokens_per_cpu_s": 10.0 * speedup}}
    assert report.goals(arms, BASE, speed)["sparrow"]["met"] is met


def test_goal_line_states_verdict_numbers_collapses_and_seeds():
    arms = {"sparse-rl-rkv": arm(0.85, 0.2, 0.02), "naive-sparse-rkv": arm(0.70, 0.2, 0.02, True)}
    goals = report.goals(arms, BASE, {})
    line = report.goal_line("naive_sparse_degrades", goals["naive_sparse_degrades"])
    assert line.startswith("- MET naive_sparse_degrades (")
    assert "+0.150" in line and "stderr 0.028" in line and "naive_collapsed seeds 0" in line
    assert "sparse-rl-rkv 0" in line
    unmeasured = report.goal_line("sparrow", goals["sparrow"])
    assert unmeasured.startswith("- NOT MET sparrow (") and "not measured" in unmeasured


def test_goal_line_of_a_measured_goal_without_a_value():
    """The dense arm gained nothing: the ratio is None, yet the goal is measured and its gains are shown."""
    arms = {"dense": arm(0.70, 0.15, 0.02), "sparse-rl-rkv": arm(0.72, 0.2, 0.02, saved=0.79)}
    goal = report.goals(arms, BASE, {})["sparse_rl_keeps_dense_gain"]
    line = report.goal_line("sparse_rl_keeps_dense_gain", goal)
    assert goal["value"] is None and ": n/a; sparse_rl_gain 0.020" in line and "gained nothing" in line


def test_recall_line_reads_both_samplers_and_empty_classes():
    table = {
        "accuracy": 0.5,
        "recalled": {"share": 0.6, "accuracy": 0.75},
        "misrecalled": {"share": 0.0, "accuracy": None},
    }
    recall = {"prompts": 2, "samples": 4, "kv": {"method": "rkv", "budget": 96}, "dense": table, "rkv": table}
    line = report.recall_line(recall)
    assert "rkv 96" in line and "dense accuracy 0.500" in line and "right 60% (accuracy 0.750)" in line
    assert "wrong 0% (accuracy n/a)" in line
