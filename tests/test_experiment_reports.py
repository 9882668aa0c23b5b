"""The reports of the SAPO and reuse experiments (experiments/sapo.py, reuse.py) on hand-made runs: the paired
comparisons and goals follow the rules written before the runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import reuse  # noqa: E402
import reuse_v2  # noqa: E402
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


def test_reuse_v2_goals_follow_their_rules(monkeypatch):
    """Speed: SPEC-RL's seconds over GRPO's per length; quality: the one-sided lower bound of the paired
    differences against the margin (df = 2), judged once every seed is in."""
    runs = {}
    machines = {f"{a}{n}-seed{s}": ["m"] for a in ("grpo", "spec") for n in (64, 256) for s in (0, 1, 2)}
    monkeypatch.setattr(reuse_v2, "load_machines", lambda: machines)
    for s, (g, a) in enumerate([(0.50, 0.52), (0.40, 0.43), (0.45, 0.44)]):
        for n, spec_s in ((64, 2.4), (256, 1.8)):
            runs[f"grpo{n}-seed{s}"] = run([9.0] * 4 + [3.0] * 20, g)
            runs[f"spec{n}-seed{s}"] = run([9.0] * 4 + [spec_s] * 20, a if n == 64 else a - 0.2)
    got = reuse_v2.with_eval_means(reuse_v2.judged_goals)(runs)
    speed64, speed256 = got[reuse_v2.speed_goal(64)], got[reuse_v2.speed_goal(256)]
    assert speed64["value"] == pytest.approx(0.8) and not speed64["met"]  # target 0.7
    assert speed256["value"] == pytest.approx(0.6) and not speed256["met"]  # target 0.5
    q64, q256 = got[reuse_v2.quality_goal(64)], got[reuse_v2.quality_goal(256)]
    diffs = [0.02, 0.03, -0.01]  # mean 0.0133, sd 0.0208, t(0.95, 2) = 2.92: bound -0.0218
    assert q64["differences"] == pytest.approx(diffs) and q64["value"] == pytest.approx(-0.0218, abs=1e-4)
    assert q64["met"] and not q256["met"]
    partial = {k: v for k, v in runs.items() if not k.endswith("seed2")}
    assert reuse_v2.judged_goals(partial)[reuse_v2.quality_goal(64)]["value"] is None
    machines["spec256-seed1"] = ["m", "another"]  # resumed on a new machine: its pair is not judged
    got = reuse_v2.judged_goals(runs)
    assert (
        got[reuse_v2.speed_goal(256)]["value"] is None
        and "seeds [1]" in got[reuse_v2.speed_goal(256)]["status"]
    )
    assert got[reuse_v2.speed_goal(64)]["met"] is False and got[reuse_v2.quality_goal(256)]["met"] is False


def test_reuse_v2_machines_note_each_run_and_copy_the_finished_parts(tmp_path, monkeypatch):
    """A run in progress gets this machine; a run that outlived an earlier machine lists both; the finished
    runs' parts are copied into the checkout once."""
    import os

    import reuse_v2_machines as m

    monkeypatch.setattr(m, "ROOT", tmp_path / "main")
    monkeypatch.setattr(m, "MACHINES", tmp_path / "main" / m.PARTS / "machines.json")
    monkeypatch.setattr(m, "this_machine", lambda: "here")
    tree = tmp_path / "tree"
    for kind in ("curves", "eval"):
        (tree / m.PARTS / kind).mkdir(parents=True)
        (tmp_path / "main" / m.PARTS / kind).mkdir(parents=True)
        (tree / m.PARTS / kind / "a-seed0.json").write_text("{}")
    for name in ("a-seed0", "b-seed0", "c-seed0"):
        (tree / "runs" / "reuse_v2" / name).mkdir(parents=True)
    os.utime(tree / "runs" / "reuse_v2" / "c-seed0", (0, 0))  # written before this machine booted
    copied = m.sync(tree)
    assert sorted(p.parent.name for p in copied) == ["curves", "eval"]
    got = m.load_machines()
    assert got == {"a-seed0": ["here"], "b-seed0": ["here"], "c-seed0": [m.EARLIER, "here"]}
    assert json.loads(m.MACHINES.read_text())["goals"] == {}
    assert m.sync(tree) == [] and m.load_machines() == got
    assert m.one_machine(got, "a-seed0", "b-seed0") and not m.one_machine(got, "a-seed0", "c-seed0")
    assert not m.one_machine(got, "a-seed0", "missing-seed0")


def test_sapo_report_adds_its_section_to_ray_json(tmp_path, monkeypatch):
    """The SAPO section lands in the Ray results file beside the Ray benchmarks' sections and goals, with
    each arm's means over the seeds it was evaluated on."""
    ray = tmp_path / "ray.json"
    ray.write_text('{"goals": {"push": {"met": true}}, "pushes": {"fp32": 1.0}}')
    monkeypatch.setattr(sapo, "RAY_RESULTS", ray)
    monkeypatch.setattr(sapo, "write_comparison", lambda x, comp: None)  # not the committed comparison
    runs = {
        f"{arm}-seed{s}": {"pass@1": 0.1 * (s + 1), "reward/mean": 0.5} for arm in sapo.ARMS for s in (0, 1)
    }
    runs["local_node0-seed2"] = {"pass@1": 0.6}  # an arm evaluated on one more seed, without training reward
    assert sapo.goals(runs) == {}
    got = json.loads(ray.read_text())
    assert got["goals"] == {"push": {"met": True}} and got["pushes"] == {"fp32": 1.0}
    assert got["sapo"]["means"]["local_node0"]["pass@1"] == pytest.approx(0.3)  # (0.1 + 0.2 + 0.6) / 3
    assert got["sapo"]["means"]["local_node0"]["reward/mean"] == pytest.approx(0.5)
    assert got["sapo"]["comparison"]["node1 pass@1: shared - local"]["mean"] == pytest.approx(0.0)
