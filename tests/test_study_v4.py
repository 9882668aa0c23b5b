"""Study v4's decision rules (experiments/study_v4_rules.py) on hand-made stage reports: no model, seconds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

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
