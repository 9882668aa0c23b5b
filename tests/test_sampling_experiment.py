"""The sampling experiment's report (experiments/sampling.py) on hand-made parts: pass@k curves, AUC and the goals'
decision rules, so a committed result can only come from the rules written before the runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import sampling as X  # noqa: E402


def test_pass_curve_is_the_unbiased_estimator_for_every_k():
    part = {"samples": 4, "correct": [0, 4, 1]}
    curve = X.pass_curve(part)
    assert curve[0] == pytest.approx((0 + 1 + 0.25) / 3)
    assert curve[-1] == pytest.approx((0 + 1 + 1) / 3)  # k = n: any correct sample counts
    assert curve == sorted(curve)


def test_ratio_goals_follow_their_direction_and_pairing():
    runs = {
        "grpo-seed0": {"sampling/solved_prompt_frac": 0.4, "sampling/zero_variance_frac": 0.6},
        "dars-seed0": {"sampling/solved_prompt_frac": 0.8},
        "vcrl-seed0": {"sampling/zero_variance_frac": 0.3},
        "dars-seed1": {"sampling/solved_prompt_frac": 0.9},  # no GRPO seed 1: not paired, left out
    }
    dars = X.goal_value("d", "dars", 1.5, runs)
    assert dars["value"] == pytest.approx(2.0) and dars["met"] and dars["seeds"] == 1
    vcrl = X.goal_value("v", "vcrl", 0.5, runs)
    assert vcrl["value"] == pytest.approx(0.5) and vcrl["met"]
    assert X.goal_value("x", "dapo_dynamic", 0.5, runs) == {
        **X.goal_value("x", "dapo_dynamic", 0.5, {}),
        "seeds": 0,
    }


def test_uniqueness_goal_needs_both_auc_and_pass1():
    def runs(d_auc, d_p1):
        return {
            **{f"grpo-seed{s}": {"auc": 0.5, "pass@1": 0.2} for s in X.SEEDS},
            **{f"uniqueness-seed{s}": {"auc": 0.5 + d_auc, "pass@1": 0.2 + d_p1} for s in X.SEEDS},
        }

    assert X.goal_value("u", "uniqueness", 0.0, runs(0.01, -0.005))["met"]
    assert not X.goal_value("u", "uniqueness", 0.0, runs(0.01, -0.02))["met"]  # pass@1 2 points lower
    assert not X.goal_value("u", "uniqueness", 0.0, runs(-0.01, 0.0))["met"]
    assert X.goal_value("u", "uniqueness", 0.0, runs(0.01, 0.0))["auc_diff"]["df"] == 2


def test_rules_are_written_before_the_runs_with_every_goal_unmeasured(tmp_path):
    import dataclasses
    import json

    import arms

    x = dataclasses.replace(X.EXPERIMENT, results_root=tmp_path)
    arms.write_rules(x)
    saved = json.loads(x.results.read_text())
    assert set(saved["goals"]) == set(X.GOALS) and not any(g["met"] for g in saved["goals"].values())
    assert saved["rules"] == X.RULES
    changed = dataclasses.replace(x, rules={**X.RULES, "dars": "another rule"})
    with pytest.raises(SystemExit, match="rules are fixed before the runs"):
        arms.report(changed, X.goals)


def test_report_judges_from_parts_and_draws_the_figure(tmp_path):
    import dataclasses
    import json

    import arms

    x = dataclasses.replace(X.EXPERIMENT, results_root=tmp_path)
    arms.write_rules(x)
    curves = {k: [0.5, None, 0.25] for k in x.curve_keys}
    for arm in ("grpo", "dars"):
        x.part("curves", arm, 0).parent.mkdir(parents=True, exist_ok=True)
        x.part("curves", arm, 0).write_text(json.dumps({"curves": curves}))
    x.part("eval", "grpo", 0).parent.mkdir(parents=True, exist_ok=True)
    x.part("eval", "grpo", 0).write_text(json.dumps({"samples": 4, "correct": [0, 4, 1]}))
    arms.report(x, X.goals)
    saved = json.loads(x.results.read_text())
    assert saved["per_run"]["grpo-seed0"]["pass@k"] == X.pass_curve({"samples": 4, "correct": [0, 4, 1]})
    assert "pass@k" not in saved["per_run"]["dars-seed0"]  # not evaluated: no held-out numbers
    assert x.results.with_suffix(".png").stat().st_size > 10_000


def test_runs_are_named_and_ordered_as_asked():
    import arms

    assert arms.run_names(X.EXPERIMENT)[:2] == [("grpo", 0), ("dars", 0)]  # seed by seed
    assert arms.run_names(X.EXPERIMENT, ["vcrl-seed2", "grpo-seed1"]) == [("vcrl", 2), ("grpo", 1)]
    with pytest.raises(SystemExit, match="unknown run"):
        arms.run_names(X.EXPERIMENT, ["grpo-seed7"])


def test_a_models_evaluation_part_counts_correct_samples_per_prompt(tmp_path, monkeypatch):
    """eval_one against the real evaluator (a tiny model stands in for the trained one): one count per prompt,
    each at most the samples drawn, with the goals mapping of a part."""
    import dataclasses
    import json

    import arms

    from sparserl.eval import loading
    from sparserl.models import tiny_model

    model, tok = tiny_model("llama", seed=0)
    stand_in = loading.LoadedModel(model, tok, "tiny", "pretrained")
    monkeypatch.setattr(loading, "load_eval_model", lambda spec: stand_in)
    x = dataclasses.replace(X.EXPERIMENT, results_root=tmp_path, eval_prompts=3, eval_samples=2)
    arms.eval_one(x, "grpo", 0)
    part = json.loads(x.part("eval", "grpo", 0).read_text())
    assert len(part["correct"]) == 3 and all(0 <= c <= 2 for c in part["correct"])
    assert part["samples"] == 2 and set(part["goals"]) == set(X.GOALS)


def test_a_run_trained_again_to_evaluate_must_reproduce_its_kept_curves(tmp_path, monkeypatch):
    import dataclasses
    import json

    import arms

    x = dataclasses.replace(X.EXPERIMENT, results_root=tmp_path)
    kept = {k: [0.5, 0.25] for k in x.curve_keys}
    x.part("curves", "grpo", 0).parent.mkdir(parents=True)
    x.part("curves", "grpo", 0).write_text(json.dumps({"curves": kept}))
    evaluated = []
    monkeypatch.setattr(arms, "evaluate_run", lambda x, script, arm, seed: evaluated.append((arm, seed)))
    again = {**kept, "time/step_cpu": [9.0, 9.0]}  # timings may differ
    monkeypatch.setattr(arms, "train_curves", lambda x, arm, seed: (tmp_path, again))
    arms.retrain(x, ["grpo-seed0", "dars-seed0"], "script")  # dars-seed0 was never trained: skipped
    assert evaluated == [("grpo", 0)]
    monkeypatch.setattr(
        arms, "train_curves", lambda x, arm, seed: (tmp_path, {**kept, "reward/mean": [0.5, 0.3]})
    )
    with pytest.raises(SystemExit, match="does not reproduce its kept curves"):
        arms.retrain(x, ["grpo-seed0"], "script")
    assert evaluated == [("grpo", 0)]


def test_goals_are_judged_only_once_every_seed_is_in():
    runs = {f"grpo-seed{s}": {"sampling/solved_prompt_frac": 0.4} for s in X.SEEDS}
    runs |= {f"dars-seed{s}": {"sampling/solved_prompt_frac": 0.8} for s in X.SEEDS[:2]}
    interim = X.goals(runs)[next(n for n, (arm, _) in X.GOALS.items() if arm == "dars")]
    assert interim["value"] == pytest.approx(2.0) and not interim["met"] and "interim" in interim["reason"]
    runs["dars-seed2"] = {"sampling/solved_prompt_frac": 0.8}
    assert X.goals(runs)[next(n for n, (arm, _) in X.GOALS.items() if arm == "dars")]["met"]


def test_uniqueness_is_paired_by_evaluations_not_by_curves():
    """Every seed trained (curves in) but one GRPO model not evaluated yet: 2 pairs, an interim value."""
    runs = {f"{arm}-seed{s}": {"auc": 0.5, "pass@1": 0.2} for arm in ("grpo", "uniqueness") for s in X.SEEDS}
    runs["grpo-seed1"] = {"sampling/solved_prompt_frac": 0.4}  # its curves only
    goal = X.goals(runs)[next(n for n, (arm, _) in X.GOALS.items() if arm == "uniqueness")]
    assert goal["seeds"] == 2 and not goal["met"] and "interim" in goal["reason"]
