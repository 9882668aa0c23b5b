"""Study v3's task generator, restate regex and decision rules (experiments/study_v3_rules.py): no model, seconds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import study_v3_rules as R  # noqa: E402

OPS = [20, 5, 5, 46, 1, 4, 7, 30, 7, 0, 6, 87]


def test_running_answer_sums_line_by_line():
    text = R.worked_answer(OPS, restate=False)
    lines = text.splitlines()
    assert len(lines) == 12 and lines[0] == "20 + 5 = 25" and lines[-1] == "The result is \\boxed{218}."
    assert not R.restates(text)


def test_restate_answer_lists_the_operands_left_every_four_lines():
    lines = R.worked_answer(OPS, restate=True).splitlines()
    left = [line for line in lines if line.startswith("Left to add:")]
    assert left == ["Left to add: 4 + 7 + 30 + 7 + 0 + 6 + 87", "Left to add: 0 + 6 + 87"]
    assert lines[-1].endswith("\\boxed{218}.")


def test_restate_regex_and_share():
    assert R.restates("1 + 2 = 3\nLeft to add: 4 + 5\n3 + 4 = 7")
    assert not R.restates("I have left to add: 4 + 5")  # not at a line start
    assert not R.restates("Left to add: four")
    assert R.restate_share(["Left to add: 3", "1 + 2 = 3", "x"]) == 1 / 3


def test_sft_mix_is_70_30():
    assert sum(R.sft_style(i) for i in range(1000)) == 300


def test_candidate_budgets_round_up_to_8():
    assert R.candidate_budgets(75) == [96, 112, 128, 144, 176, 208]


def test_budget_rule_smallest_qualifying():
    def row(reward, off, k3, saving):
        return {"reward": reward, "frac_off": off, "kl_k3": k3, "retained_saving": saving}

    rows = {96: row(0.2, 0.2, 0.2, 0.6), 112: row(0.4, 0.05, 0.01, 0.5), 128: row(0.45, 0.01, 0.01, 0.4)}
    assert R.choose_budget(rows, 0.5) == 112  # 96: reward too low; 128: too little mismatch
    rows[112]["retained_saving"] = 0.3
    assert R.choose_budget(rows, 0.5) is None


def test_retained_saving():
    assert R.retained_saving([50, 50], [150, 50], 100) == 1 - 200 / 300


def test_sft_stop_needs_reward_and_length():
    assert R.sft_done({"dense_reward": 0.35, "mean_length": 120})
    assert not R.sft_done({"dense_reward": 0.34, "mean_length": 120})
    assert not R.sft_done({"dense_reward": 0.9, "mean_length": 99})


def test_pilot_lr_rule():
    assert R.pilot_lr([0.01] * 10, [0.3] * 5 + [0.4] * 5, 5e-5) == (5e-5, "kept")
    assert R.pilot_lr([0.2], [0.3] * 10, 5e-5)[0] == 2.5e-5
    assert R.pilot_lr([0.01] * 10, [0.4] * 5 + [0.3] * 5, 5e-5)[0] == 2.5e-5


def test_collapse_rule_clauses():
    flat = [0.5] * 40
    assert not R.collapsed(flat, [100] * 40, [0.0] * 40)["collapsed"]
    assert R.collapsed([0.5] * 30 + [0.1] * 10, [100] * 40, [0.0] * 40)["reward_fell"]
    assert not R.collapsed([0.2] * 30 + [0.0] * 10, [100] * 40, [0.0] * 40)["collapsed"]  # below the floor
    assert R.collapsed(flat, [100] * 40, [0.0] * 30 + [0.3] * 10)["truncated"]
    assert R.collapsed(flat, [100] * 10 + [170] * 30, [0.0] * 40)["length_grew"]


def test_paired_test_and_holm():
    t = R.paired_one_sided([0.6, 0.7, 0.65, 0.62], [0.5, 0.55, 0.52, 0.5])
    assert t["df"] == 3 and t["p"] < 0.01
    assert R.paired_one_sided([0.5, 0.4, 0.5, 0.4], [0.5, 0.5, 0.5, 0.5])["p"] > 0.5
    assert R.holm({"a": 0.01, "b": 0.02, "c": 0.04}) == {"a": True, "b": True, "c": True}
    assert R.holm({"a": 0.01, "b": 0.03, "c": 0.04}) == {"a": True, "b": False, "c": False}


def test_equivalence_and_bootstrap():
    assert R.equivalent([0.001, -0.002, 0.0, 0.001])["equivalent"]
    assert not R.equivalent([0.04, -0.04, 0.06, -0.06])["equivalent"]
    b = R.gain_ratio_bootstrap([0.1, 0.12, 0.08, 0.1], [0.2, 0.2, 0.2, 0.2], 2000)
    assert b["ratio"] == 0.5 and b["ci95"][0] <= 0.5 <= b["ci95"][1]


def test_validity_gate():
    ok = R.validity_gate(
        [0.1, 0.09, 0.12, 0.1], {"dense": 0.4, "naive-sparse-rkv": 0.3, "sparse-rl-rkv": 0.25}
    )
    assert ok["passed"]
    bad = R.validity_gate([0.05] * 4, {"dense": 0.4, "naive-sparse-rkv": 0.1, "sparse-rl-rkv": 0.3})
    assert not bad["passed"] and len(bad["reasons"]) == 2


def test_warmstart_goal_reads_the_best_probe_and_the_done_flag():
    state = {"rungs": {"12x2": {"probes": [{"dense_reward": 0.2}, {"dense_reward": 0.3}]}}}
    goal = R.warmstart_goals(state)["warm start reaches the start level"]
    assert goal["value"] == 0.3 and goal["met"] is False and goal["target"] == 0.35
    assert R.warmstart_goals({**state, "done": True})["warm start reaches the start level"]["met"] is True
    failed = {**state, "done": True, "failed": True}
    assert R.warmstart_goals(failed)["warm start reaches the start level"]["met"] is False
    assert R.warmstart_goals({})["warm start reaches the start level"]["value"] is None


def test_no_budget_at_the_first_scoping_moves_every_later_stage_to_16_operands(tmp_path, monkeypatch):
    """The budget rule's fallback: the first scoping chose none, so setting() and the arms' overrides use
    RESCOPE_OPERANDS, and the budget is read from the re-scope's file."""
    import json

    import pytest
    import study_v3 as S

    monkeypatch.setattr(S, "RESULTS", tmp_path)
    (tmp_path / "warmstart.json").write_text(json.dumps({"rung": [12, 1]}))
    assert not S.rescoped() and S.setting().task.num_operands == 12
    (tmp_path / "scoping.json").write_text(json.dumps({"complete": True, "chosen_budget": None}))
    assert S.rescoped() and S.setting().task.num_operands == S.RESCOPE_OPERANDS == 16
    assert "task.num_operands=16" in S.arm_overrides("dense", 0, 5e-5)
    with pytest.raises(SystemExit, match="scoping_16_operands.json: no budget chosen"):
        S.budget()
    (tmp_path / "scoping_16_operands.json").write_text(json.dumps({"complete": True, "chosen_budget": 152}))
    assert S.budget() == 152


def test_report_records_goals_stopped_by_the_budget_rule_as_not_run(tmp_path, monkeypatch):
    """Neither scoping chose a budget, so no arm trained: every goal is neither met nor missed ("met": null)
    with the status "not run: stopped by rule", not recorded as failed."""
    import json

    import study_v3_report as report

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    for name in ("scoping.json", "scoping_16_operands.json"):
        (tmp_path / name).write_text(json.dumps({"complete": True, "chosen_budget": None}))
    out = report.report()
    assert out["stopped_by_rule"] is True and set(out["goals"]) == set(R.GOALS)
    for goal in out["goals"].values():
        assert goal["met"] is None and goal["status"] == "not run: stopped by rule"
        assert "not testable by study v3's design" in goal["reason"]
    assert json.loads((tmp_path / "study_v3.json").read_text())["goals"] == out["goals"]
