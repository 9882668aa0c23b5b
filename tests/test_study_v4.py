"""Study v4's decision rules (experiments/study_v4_rules.py) on hand-made stage reports: no model, seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import study_v4_r5 as B  # noqa: E402
import study_v4_rules as R  # noqa: E402


def v(value, low=None, high=None):
    return {"value": value, "low": value if low is None else low, "high": value if high is None else high}


def a1_report(ratio_low: float, nondegenerate: float = 0.8, saving: float = 0.4) -> dict:
    return {"complete": True, "rollout": {"reward_ratio": v(0.8, ratio_low, 1.0),
            "nondegenerate_groups": v(nondegenerate), "kv_saving_mean_held": v(saving),
            "config/touched_share": v(0.2)}}  # fmt: skip


def test_r1_needs_reward_groups_and_for_eviction_a_saving():
    assert R.a1_row("rkv104", a1_report(0.55))["eligible"]
    assert not R.a1_row("rkv104", a1_report(0.45))["eligible"]  # reward ratio's lower bound below 0.5
    assert not R.a1_row("rkv104", a1_report(0.6, nondegenerate=0.4))["eligible"]
    assert not R.a1_row("rkv104", a1_report(0.6, saving=0.2))["eligible"]
    assert R.a1_row("block_topk64", a1_report(0.6, saving=0.0))["eligible"]  # keeps all KV: no saving gate


def test_a2_takes_eligible_samplers_first_then_the_closest():
    rows = {k: R.a1_row(k, a1_report(0.3)) for k in R.SAMPLERS}
    rows["rkv136"] = R.a1_row("rkv136", a1_report(0.7))
    rows["random128"] = R.a1_row("random128", a1_report(0.45))
    rows["rkv128"] = R.a1_row("rkv128", a1_report(0.49))
    chosen = R.a2_samplers(rows)
    assert chosen[0] == "dense" and chosen[-2:] == list(R.CONTROLS)
    assert chosen[1:3] == ["rkv136", "rkv128"] and chosen[3] == "random128" and len(chosen) == 7


def test_r2_extension_reads_the_interval_widths():
    narrow = {"estimators": {"config": {"gamma": v(0.2, 0.17, 0.23), "cosine_gain": v(0.1, 0.08, 0.12)}}}
    wide = {"estimators": {"config": {"gamma": v(0.2, 0.05, 0.35), "cosine_gain": v(0.1, 0.08, 0.12)}}}
    assert not R.r2_extend(narrow) and R.r2_extend(wide)


def a2_report(verdict: str, gain_low: float, touched: float, naive_cos: float) -> dict:
    est = {
        "naive": {"cosine": v(naive_cos)},
        "config": {"verdict": verdict, "relative_cosine_gain": v(gain_low + 0.1, gain_low, gain_low + 0.2)},
    }
    ro = {"config/touched_share": v(touched), "config/tis_truncation_share": v(0.01),
          "config/veto_catch_of_truncated": v(0.0)}  # fmt: skip
    return {"complete": True, "estimators": est, "rollout": ro}


def test_judge_applies_r3_r4_and_r6():
    a1 = {k: a1_report(0.6) for k in R.SAMPLERS}
    a2 = {"dense": a2_report("inert", -0.1, 0.0, 1.0), "rkv120": a2_report("corrections matter", 0.3, 0.3, 0.8),
          "rkv136": a2_report("inconclusive", 0.1, 0.1, 0.95), "temp1.15": a2_report("inconclusive", 0.1, 0.4, 0.7),
          "temp1.3": a2_report("corrections matter", 0.5, 0.6, 0.5)}  # fmt: skip
    out = R.judge(a1, a2, 12.0)
    assert out["R1"]["status"] == "judged" and out["R3"]["passed"] is True
    assert out["R4"]["gated_samplers"] == ["rkv120"] and out["R4"]["stage"] == "B"
    assert out["R6"]["rho"] == pytest.approx(1.0) and out["R6"]["supported"]
    assert out["R5"]["status"] == "not run"
    missing = R.judge({}, {}, None)
    assert missing["R1"]["status"] == missing["R3"]["status"] == missing["R6"]["status"] == "not run"


# ---- stage B: the plan, R5 and the validity gate -----------------------------------------------------------


def estimators(rel_low: float, gain_low: float) -> dict:
    return {"estimators": {"config": {"relative_cosine_gain": v(rel_low + 0.1, rel_low, rel_low + 0.2),
                                      "cosine_gain": v(gain_low + 0.1, gain_low, gain_low + 0.2)}}}  # fmt: skip


def test_stage_b_trains_the_gated_sampler_with_the_largest_gain_else_a_temperature():
    a2 = {"rkv120": estimators(0.3, 0.1), "rkv136": estimators(0.5, 0.05), "temp1.15": estimators(0.1, 0.2),
          "temp1.3": estimators(0.2, 0.3)}  # fmt: skip
    judged = {"R4": {"status": "judged", "gated_samplers": ["rkv120", "rkv136"]}}
    p = B.plan(judged, a2)
    assert (p["stage"], p["sampler"], p["evicting"]) == ("B", "rkv136", True)
    assert p["arms"]["naive"] == ["algo.preset=naive-sparse", *R.SAMPLERS["rkv136"]]
    assert p["arms"]["dense"][0] == "algo.preset=dense" and p["seeds"] == [0, 1, 2, 3]
    p = B.plan({"R4": {"status": "judged", "gated_samplers": []}}, a2)
    assert (p["stage"], p["sampler"], p["evicting"]) == ("B'", "temp1.3", False)
    with pytest.raises(SystemExit, match="R4 is not judged"):
        B.plan({"R4": {"status": "not run"}}, a2)


def test_paired_t_and_holm_against_scipy_and_by_hand():
    from scipy.stats import ttest_1samp

    diffs = [0.10, 0.09, 0.09, 0.11]
    want = ttest_1samp(diffs, 0.0, alternative="greater").pvalue
    assert B.one_sided_t(diffs)["p"] == pytest.approx(want)
    assert B.one_sided_t(diffs, 0.05, greater=False)["p"] == pytest.approx(
        ttest_1samp(diffs, 0.05, alternative="less").pvalue
    )
    ci = ttest_1samp(diffs, 0.0).confidence_interval(0.90)
    assert B.one_sided_t(diffs)["interval_90"] == pytest.approx([ci.low, ci.high])
    assert B.holm({"a": 0.01, "b": 0.04}, 0.05) == {"a": True, "b": True}
    assert B.holm({"a": 0.03, "b": 0.04}, 0.05) == {"a": False, "b": False}  # 0.03 > 0.05 / 2 stops it
    assert B.holm({"a": 0.01, "b": 0.06}, 0.05) == {"a": True, "b": False}


def test_r5_and_the_validity_gate_on_hand_made_runs():
    acc = {
        "dense": [0.45, 0.42, 0.40, 0.44],
        "naive": [0.30, 0.32, 0.28, 0.31],
        "sparse-rl": [0.40, 0.41, 0.37, 0.42],
    }
    heldout = {"start": {"dense": {"mean@4": 0.30}, "sparse": {"mean@4": 0.20}}}
    for arm, values in acc.items():
        for s, a in enumerate(values):
            heldout[f"{arm}-s{s}"] = {
                "dense": {"mean@4": a},
                "sparse": {"mean@4": a - (0.1 if arm == "dense" else 0.05)},
            }
    early = {"dense": 0.4, "naive": 0.1, "sparse-rl": 0.3}  # naive's early reward is 0.25x dense's: invalid
    curves = {f"{arm}-s{s}": [{"step": t, "reward/mean": early[arm], "rollout_corr/k3_kl": 0.02} for t in range(1, 29)]
              for arm in acc for s in range(4)}  # fmt: skip
    p = {"stage": "B", "sampler": "rkv136", "evicting": True, "seeds": [0, 1, 2, 3], "rollouts": 28}
    a1 = {"rollout": {"k3_token": v(0.03)}}
    out = B.judge_r5(p, heldout, curves, a1, estimators(0.5, 0.1))
    assert out["primary"]["mean"] == pytest.approx(0.0975) and out["primary"]["significant"]
    assert not out["tost"]["equivalent"]
    assert out["secondary"]["SRL - dense under sparse inference > 0"]["mean"] == pytest.approx(
        sum(a - d for a, d in zip(acc["sparse-rl"], acc["dense"], strict=True)) / 4 + 0.05
    )
    dense_gain = sum(acc["dense"]) / 4 - 0.30
    assert out["first_order"]["predicted_gap"] == pytest.approx(
        [0.6 * dense_gain, 0.5 * dense_gain, 0.7 * dense_gain]
    )
    assert out["first_order"]["inside"] is False  # 0.0975 lies above 0.7 x 0.1275
    gate = out["validity"]
    assert gate["dense_gain"]["passed"] and gate["sparse-rl_early_reward_ratio"]["value"] == pytest.approx(
        0.75
    )
    assert not gate["naive_early_reward_ratio"]["passed"] and not gate["passed"]
    assert (
        gate["naive_mismatch_kept"]["value"] == pytest.approx(2 / 3) and gate["naive_mismatch_kept"]["passed"]
    )


def point(noise: str, batches: int, gain: float, clamped: tuple, unclamped: tuple) -> dict:
    """A simulated grid point: (share with the gain's lower bound > 0, share whose c_naive interval held the truth)
    per statistic."""
    shares = lambda s: {"gain_low_above_0": s[0], "c_naive_covered": s[1], "gain_covered": 0.9}  # noqa: E731
    return {"noise": noise, "batches": batches, "true_gain": gain, "clamped": shares(clamped),
            "unclamped": shares(unclamped)}  # fmt: skip


def test_the_instrument_check_selects_the_unclamped_statistic_only_where_it_is_calibrated():
    import study_v4_instrument as I

    grid = [point("temp1.3", 12, 0.0, (0.0, 0.95), (0.03, 0.95)), point("temp1.3", 12, 0.05, (0.13, 0.94), (0.85, 0.93)),
            point("temp1.3", 12, 0.1, (0.67, 0.9), (0.96, 0.9))]  # fmt: skip
    judged = I.judge(grid, I.RULES)
    assert judged["calibrated"] == {"clamped": True, "unclamped": True}
    assert judged["clamp_defect"] and judged["selected_statistic"] == "unclamped"
    assert judged["resolution"] == {"clamped/temp1.3/K12": None, "unclamped/temp1.3/K12": 0.05}
    assert judged["r3_rejudged_on_fresh_batches"]
    grid[1]["unclamped"]["c_naive_covered"] = 0.79  # one point under-covers: nothing is calibrated
    judged = I.judge(grid, I.RULES)
    assert not judged["calibrated"]["unclamped"] and not judged["clamp_defect"]
    assert not judged["r3_rejudged_on_fresh_batches"]  # the clamped statistic resolves no gain at K = 12
    grid[0]["unclamped"]["gain_low_above_0"] = 0.2  # a false gain in a fifth of the null replicates
    assert not I.judge(grid, I.RULES)["calibrated"]["unclamped"]


def test_span_coordinates_take_batches_by_index_and_keep_every_inner_product(tmp_path, monkeypatch):
    """Batches first..last-1 are read by their index (a split measurement may lack the others), and their
    coordinates reproduce every inner product; a missing batch is named."""
    import study_v4_instrument as I
    import torch

    from sparserl.eval.bias_command import batch_path

    monkeypatch.setattr(I, "RUNS", tmp_path)
    folder = tmp_path / "s" / "batches"
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    grads = {k: {e: torch.randn(50, generator=gen, dtype=torch.float64) for e in "ab"} for k in (2, 3, 4)}
    for k, g in grads.items():
        torch.save({"grads": g}, batch_path(tmp_path / "s", k))
    coords = I.span_coordinates("s", 2, 5, ("a", "b"))
    stacked = torch.cat([torch.stack([grads[k][e] for k in (2, 3, 4)]) for e in "ab"])
    joint = torch.cat([coords["a"], coords["b"]])
    assert torch.allclose(joint @ joint.T, stacked @ stacked.T, atol=1e-9)
    with pytest.raises(SystemExit, match="lacks batches 0001"):
        I.span_coordinates("s", 1, 5, ("a", "b"))


def test_run_bias_runs_its_parts_side_by_side_then_reports(tmp_path, monkeypatch):
    """a2 --processes 2: one `sparserl bias --part i/2` process per share, all waited for, then the unsplit
    command writes the report that is copied (goals emptied); a failed part stops before any report."""
    import study_v4 as S

    monkeypatch.setattr(S, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(S, "RESULTS", tmp_path / "results")
    started, reported = [], []

    class Part:
        def __init__(self, cmd, cwd):
            started.append(cmd[cmd.index("--part") + 1])

        def wait(self):
            return int(fail and started[-1] == "2/2")

    def run(cmd, check, cwd):
        reported.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        S.write(out / "bias.json", {"goals": {"x": 1}, "cpu_s": {"total": 7.0}})

    monkeypatch.setattr(S.subprocess, "Popen", Part)
    monkeypatch.setattr(S.subprocess, "run", run)
    fail = False
    parts = S.split(type("Args", (), {"processes": 2})())
    report = S.run_bias("a2", "rkv136", 24, "config", parts)
    assert started == ["1/2", "2/2"] and "--part" not in reported[0]
    assert report["goals"] == {} and S.read(tmp_path / "results" / "a2" / "rkv136.json") == report
    fail, started[:] = True, []
    with pytest.raises(SystemExit, match="a part of the measurement failed"):
        S.run_bias("a2", "rkv128", 24, "config", parts)
    assert started == ["1/2", "2/2"] and len(reported) == 1


def test_train_runs_side_by_side_in_seed_major_order_and_a_failure_starts_no_other(tmp_path, monkeypatch):
    """train --processes 2: at most two runs at once, each finished run's metrics copied; committed runs are
    skipped; a failed run lets the running one finish and starts no other."""
    import threading
    import time

    import study
    import study_v4_train as T

    plan = {"stage": "B", "seeds": [0, 1], "arms": {"a": ["x=1"], "b": []}, "rollouts": 3}
    monkeypatch.setattr(T, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(T, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(T, "stage_plan", lambda: plan)
    T.write(tmp_path / "results" / "pilot.json", {"lr": 1e-5})
    lock, active, started = threading.Lock(), [0], []

    def train_arm(out, name, overrides, extra, config):
        with lock:
            started.append((name, overrides))
            active[0] += 1
        time.sleep(0.05)
        with lock:
            active.append(active[0])
            active[0] -= 1
        if name == failing:
            raise SystemExit(f"arm {name}: training exited with status 1")
        (out / name).mkdir(parents=True)
        (out / name / "metrics.jsonl").write_text(f"{name}\n")
        return out / name

    monkeypatch.setattr(study, "train_arm", train_arm)
    failing = None
    (tmp_path / "results" / "b").mkdir(parents=True)
    (tmp_path / "results" / "b" / "b-s1.jsonl").write_text("committed\n")
    T.train(type("Args", (), {"processes": 2})())
    assert [n for n, _ in started] == ["a-s0", "b-s0", "a-s1"] and max(active[1:]) == 2
    assert started[0][1] == ["x=1", "trainer.seed=0", "trainer.steps=3", "optim.lr=1e-05"]
    assert (tmp_path / "results" / "b" / "a-s1.jsonl").read_text() == "a-s1\n"
    for f in (tmp_path / "results" / "b").glob("[ab]-s0.jsonl"):
        f.unlink()
    (tmp_path / "results" / "b" / "a-s1.jsonl").unlink()
    started[:], failing = [], "a-s0"
    with pytest.raises(SystemExit, match="arm a-s0"):
        T.train(type("Args", (), {"processes": 1})())
    assert [n for n, _ in started] == ["a-s0"]


def two_trained_models(tmp_path, monkeypatch):
    """study_v4_train with its results and claims under tmp_path: a one-seed plan whose two runs are trained
    and whose warm start is held out."""
    import study_v4_train as T

    plan = {"stage": "B", "seeds": [0], "arms": {"a": [], "b": []}, "rollouts": 3}
    monkeypatch.setattr(T, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(T, "CLAIMS", tmp_path / "claims")
    monkeypatch.setattr(T, "stage_plan", lambda: plan)
    for name in ("a-s0", "b-s0"):
        T.write(tmp_path / "results" / "b" / f"{name}.jsonl", {})
    T.write(tmp_path / "results" / "heldout" / "start.json", {"mean": 0.5})
    return T


def test_evaluate_holds_out_each_model_in_its_own_process_side_by_side(tmp_path, monkeypatch):
    """evaluate --processes 2: one `eval-one` process per model without a held-out JSON; a failed one names the
    model, and no other starts after it."""
    T = two_trained_models(tmp_path, monkeypatch)
    called, failing = [], []

    def run(cmd, cwd):
        called.append(cmd[2:4])
        return type("Done", (), {"returncode": 1 if cmd[3] in failing else 0})()

    monkeypatch.setattr(T.subprocess, "run", run)
    T.evaluate(type("Args", (), {"processes": 2})())
    assert sorted(called) == [["eval-one", "a-s0"], ["eval-one", "b-s0"]]
    called[:], failing[:] = [], ["a-s0"]
    with pytest.raises(SystemExit, match="held-out evaluation of a-s0 failed"):
        T.evaluate(type("Args", (), {"processes": 1})())
    assert called == [["eval-one", "a-s0"]]
    assert not list((tmp_path / "claims").iterdir())  # a failed evaluation leaves no claim behind


def test_two_evaluate_commands_share_the_models_by_claim(tmp_path, monkeypatch):
    """A model claimed by a live evaluator is left to it; a claim whose process has died is taken over."""
    T = two_trained_models(tmp_path, monkeypatch)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "claims").mkdir()
    (tmp_path / "claims" / "a-s0").write_text(str(os.getppid()))  # alive: another evaluate
    (tmp_path / "claims" / "b-s0").write_text(str(dead.pid))
    called = []
    monkeypatch.setattr(
        T.subprocess, "run", lambda cmd, cwd: called.append(cmd[3]) or type("Done", (), {"returncode": 0})()
    )
    T.evaluate(type("Args", (), {"processes": 1})())
    assert called == ["b-s0"]
    assert [p.name for p in (tmp_path / "claims").iterdir()] == ["a-s0"]
