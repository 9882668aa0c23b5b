"""Study v4's stage B (or B'), the parts that need no model: which sampler and arms train (from R4, fixed in
study_v4.json when first chosen), and R5 with the validity gate judged from the held-out evaluations and the
training curves. The rules themselves are study_v4_rules.RULES["R5"] and ["validity"], committed before A1.
"""

from __future__ import annotations

import math
from statistics import mean, stdev

import study_v4_rules as R

ARMS = ("dense", "naive", "sparse-rl")
PRESET = {
    "dense": "algo.preset=dense",
    "naive": "algo.preset=naive-sparse",
    "sparse-rl": "algo.preset=sparse-rl",
}


def plan(judged: dict, a2: dict[str, dict]) -> dict:
    """Stage B at the gated sampler with the largest lower bound of c_SRL / c_naive - 1 (R4), else stage B' at
    the temperature control with the largest c_SRL - c_naive; each arm's overrides of experiments/study_v4.yaml
    (the dense arm samples densely; naive and Sparse-RL with the chosen sampler)."""
    r4 = judged["R4"]
    if r4["status"] != "judged":
        raise SystemExit(
            "R4 is not judged yet: finish stage A2, then `python experiments/study_v4.py report`"
        )

    def low(name: str, stat: str) -> float:
        return a2[name]["estimators"]["config"][stat]["low"] or -math.inf

    if r4["gated_samplers"]:
        stage, sampler = "B", max(r4["gated_samplers"], key=lambda k: low(k, "relative_cosine_gain"))
    else:
        stage, sampler = "B'", max(R.CONTROLS, key=lambda k: low(k, "cosine_gain"))
    arms = {"dense": [PRESET["dense"], *R.SAMPLERS["dense"]]}
    arms |= {arm: [PRESET[arm], *R.SAMPLERS[sampler]] for arm in ("naive", "sparse-rl")}
    return {"stage": stage, "sampler": sampler, "evicting": sampler in R.EVICTING, "arms": arms,
            "seeds": R.RULES["R5"]["seeds"], "rollouts": R.RULES["R5"]["rollouts"]}  # fmt: skip


def one_sided_t(diffs: list[float], margin: float = 0.0, greater: bool = True) -> dict:
    """Paired one-sided t of mean(diffs) > margin (or < margin), df = n - 1, with the two-sided 90% interval of
    the mean (the one whose ends are the one-sided 5% tests, as in the TOST)."""
    from scipy.stats import t

    n, m = len(diffs), mean(diffs)
    se = stdev(diffs) / math.sqrt(n)
    if se == 0:
        p = 0.0 if (m > margin if greater else m < margin) else 1.0
    else:
        stat = (m - margin) / se
        p = float(t.sf(stat, n - 1) if greater else t.cdf(stat, n - 1))
    half = float(t.ppf(0.95, n - 1)) * se
    return {
        "mean": m,
        "n": n,
        "df": n - 1,
        "p": p,
        "interval_90": [m - half, m + half],
        "per_seed": list(diffs),
    }


def holm(ps: dict[str, float], alpha: float) -> dict[str, bool]:
    """Holm's step-down rejections at family-wise `alpha`."""
    out, k = {}, len(ps)
    for i, (name, p) in enumerate(sorted(ps.items(), key=lambda kv: kv[1])):
        out[name] = p < alpha / (k - i) and all(out.values())
    return out


def heldout_diffs(
    heldout: dict[str, dict], a: str, b: str, seeds: list[int], mode: str = "dense"
) -> list[float]:
    """Per seed, arm a's held-out mean@4 minus arm b's ('start': the warm start, one model for every seed)."""

    def acc(arm: str, s: int) -> float:
        return heldout["start" if arm == "start" else f"{arm}-s{s}"][mode]["mean@4"]

    return [acc(a, s) - acc(b, s) for s in seeds]


def judge_r5(p: dict, heldout: dict[str, dict], curves: dict[str, list[dict]], a1_sampler: dict,
             a2_sampler: dict) -> dict:  # fmt: skip
    """R5: the primary test (Sparse-RL minus naive, dense held-out accuracy, one-sided paired t), the Holm
    secondaries, the TOST at +-margin, and whether the gap lies in the first-order prediction's interval."""
    r5, seeds = R.RULES["R5"], p["seeds"]
    primary = one_sided_t(heldout_diffs(heldout, "sparse-rl", "naive", seeds))
    gap = primary["mean"]
    lower = one_sided_t(heldout_diffs(heldout, "sparse-rl", "naive", seeds), -r5["tost_margin"])
    upper = one_sided_t(heldout_diffs(heldout, "sparse-rl", "naive", seeds), r5["tost_margin"], greater=False)
    dense_gain = mean(heldout_diffs(heldout, "dense", "start", seeds))
    srl_gain = heldout_diffs(heldout, "sparse-rl", "start", seeds)
    dense_each = heldout_diffs(heldout, "dense", "start", seeds)
    secondary = {"gain(SRL) - 0.75 gain(dense) > 0": one_sided_t(
        [s - 0.75 * d for s, d in zip(srl_gain, dense_each, strict=True)])}  # fmt: skip
    if p["evicting"]:
        secondary["SRL - dense under sparse inference > 0"] = one_sided_t(
            heldout_diffs(heldout, "sparse-rl", "dense", seeds, mode="sparse")
        )
    rejected = holm({k: v["p"] for k, v in secondary.items()}, r5["alpha"])
    rel = a2_sampler["estimators"]["config"]["relative_cosine_gain"]
    predicted = [rel[k] * dense_gain if rel[k] is not None else None for k in ("value", "low", "high")]
    inside = None if None in predicted else min(predicted[1:]) <= gap <= max(predicted[1:])
    return {
        "status": "judged", "stage": p["stage"], "sampler": p["sampler"],
        "primary": {**primary, "significant": primary["p"] < r5["alpha"]},
        "tost": {"p": max(lower["p"], upper["p"]), "margin": r5["tost_margin"],
                 "equivalent": max(lower["p"], upper["p"]) < r5["alpha"]},
        "secondary": {k: {**v, "rejected_holm": rejected[k]} for k, v in secondary.items()},
        "first_order": {"predicted_gap": predicted, "observed_gap": gap, "inside": inside},
        "validity": validity(p, heldout, curves, a1_sampler),
    }  # fmt: skip


def curve_mean(rows: list[dict], key: str, steps: range) -> float | None:
    """Mean of `key` over the metrics rows whose step lies in `steps` (None when none has it)."""
    got = [r[key] for r in rows if r.get("step") in steps and r.get(key) is not None]
    return mean(got) if got else None


def validity(p: dict, heldout: dict[str, dict], curves: dict[str, list[dict]], a1_sampler: dict) -> dict:
    """The validity gate's clauses (R3 is read by `report`): the dense gain, each eviction arm's early reward
    against dense's, and the sampler's mismatch over the last 10 rollouts against its A1 value. Training logs
    no touched share (`sparserl bias` computes it), so the mismatch clause reads rollout_corr/k3_kl against A1's
    k3_token, the same per-token k3."""
    v, seeds, last = R.RULES["validity"], p["seeds"], range(p["rollouts"] - 9, p["rollouts"] + 1)
    gain = mean(heldout_diffs(heldout, "dense", "start", seeds))
    out: dict = {
        "dense_gain": {"value": gain, "min": v["dense_gain_min"], "passed": gain >= v["dense_gain_min"]}
    }

    def arm_mean(arm: str, key: str, steps: range) -> float | None:
        got = [curve_mean(curves[f"{arm}-s{s}"], key, steps) for s in seeds]
        return mean(got) if None not in got else None

    dense_early = arm_mean("dense", "reward/mean", range(1, 11))
    for arm in ("naive", "sparse-rl"):
        early = arm_mean(arm, "reward/mean", range(1, 11))
        ratio = early / dense_early if early is not None and dense_early else None
        out[f"{arm}_early_reward_ratio"] = (
            {"value": ratio, "min": v["early_reward_ratio_min"],
             "passed": ratio is not None and ratio >= v["early_reward_ratio_min"]}
            if p["evicting"] else {"status": "not applicable: the sampler evicts nothing"}
        )  # fmt: skip
        k3 = arm_mean(arm, "rollout_corr/k3_kl", last)
        start = a1_sampler["rollout"]["k3_token"]["value"]
        kept = k3 / start if k3 is not None and start else None
        out[f"{arm}_mismatch_kept"] = {"value": kept, "min": v["mismatch_kept_min"],
                                       "passed": kept is not None and kept >= v["mismatch_kept_min"]}  # fmt: skip
    out["passed"] = all(c.get("passed", True) for c in out.values() if isinstance(c, dict))
    return out
