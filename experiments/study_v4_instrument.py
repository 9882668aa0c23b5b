"""Study v4's instrument check, run because R3 failed (the temperature-1.3 control came out "inconclusive").

Does the cosine statistic of `sparserl bias` cover a known truth, and how small a cosine gain c_X - c_naive does it
resolve, under the noise of the real per-batch gradients? Each synthetic batch is a known expected gradient per
estimator plus noise drawn with the committed batches' own covariance (the same normal weights on every estimator's
deviations, so the coupling of a sparse sample and its dense twin is kept); all of it lives in the span of the real
gradients, whose inner products are kept exactly. The rules are written into study_v4.json (`instrument_check`)
before the simulation runs (`rules`), and judged by `run`.

    python experiments/study_v4_instrument.py rules   # write the rules (commit before `run`)
    python experiments/study_v4_instrument.py run     # about 0.1 CPU-hours
    python experiments/study_v4_instrument.py round2-rules  # R3's second round, written before its batches
    python experiments/study_v4_instrument.py round2  # about 2.2 CPU-hours, resumable per batch
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from study_v3 import read, write

from sparserl.eval.bias_command import batch_path
from sparserl.eval.bias_stats import gradient_report, gram, pair_means, verdict

ROOT = Path(__file__).resolve().parent.parent
RUNS, JSON = ROOT / "runs" / "study_v4" / "a2", ROOT / "docs" / "results" / "study_v4" / "study_v4.json"
ESTIMATORS = ("naive", "config", "dense")  # config: the sparse-rl preset, the estimator R2 and R3 judge

RULES = {
    "why": "R3 failed: at temperature 1.3, Sparse-RL's cosine gain was 0.008 [0.000, 0.025]; both cosines' "
    "intervals reach exactly 1.000 and the gain's lower bound is exactly 0.000. Check whether the statistic covers "
    "a known truth and what gain it resolves, before any rerun judges anything.",
    "model": "synthetic batches g_X,k = m_X + sum_j z_kj d_X,j / sqrt(K0 - 1), z ~ N(0, 1) shared by the "
    "estimators, d_X,j the deviations of the K0 = 12 committed batches of a sampler (runs/study_v4/a2/NAME); truth "
    "m_dense = the committed dense mean; m_X = r_X |m_dense| (c_X u + sqrt(1 - c_X^2) v_X), u the dense direction, "
    "v_X the part of the committed mean of X orthogonal to u, r_X the committed relative norm of X",
    "noise_sources": ["temp1.3", "rkv136"],
    "grid": {"c_naive": [1.0, 0.99, 0.98, 0.95, 0.9, 0.95], "c_config": [1.0, 1.0, 1.0, 1.0, 1.0, 0.95]},
    "batches": [12, 24],
    "replicates": 300,
    "draws": 2000,
    "statistics": {
        "clamped": "cosines clamped to [-1, 1] (the statistic R2 and R3 used)",
        "unclamped": "the ratio of unbiased pair means, unclamped",
    },
    "I1_calibrated": "a statistic is calibrated if, at every grid point with a true gain of 0, the share of "
    "replicates whose gain lower bound is > 0 is <= 0.10 (nominal 0.05), and c_naive's 90% interval holds the "
    "truth in >= 0.80 of the replicates at every grid point",
    "I2_clamp_defect": "the clamp is a defect if the unclamped statistic is calibrated and its power (share of "
    "replicates with the gain's lower bound > 0) exceeds the clamped one's by >= 0.20 at some true gain > 0",
    "I3_resolution": "per statistic, noise source and K: the smallest true gain of the grid detected in >= 0.80 "
    "of the replicates",
    "consequence": "whatever I1-I3 give, R3 is re-judged only on fresh batches: the temperature-1.3 control "
    "extended to K = 24 (batches 13-24 are new prompts and samples), judged on batches 13-24 alone (K = 12) with "
    "the statistic I1-I2 select (the unclamped one if I2 finds the clamp a defect, else the clamped one), R2's "
    "thresholds unchanged; the pooled K = 24 is reported beside it. If no statistic is calibrated (I1), or the "
    "selected one's resolution at K = 12 on the temp1.3 noise is coarser than every grid gain, R3 stays failed "
    "and the study concludes nothing: the instrument cannot check itself at this scale.",
}


ROUND2 = {
    "why": "the first check (`rules`, `points`, `judged`) left R3 failed by its own rule; it also measured the "
    "instrument: at K = 24 every c_naive interval held the truth in 0.82-0.97 of the replicates, the unclamped "
    "gain's in 0.87-0.99 (the clamped one's in 0.66-1.00), the unclamped statistic's size <= 0.04, and its power at "
    "a gain of 0.02 was 0.57-0.71 against the clamped one's 0.04-0.21. Written before any new batch is judged.",
    "instrument": "K = 24 batches; cosines unclamped (sparserl bias reports them so from now on)",
    "R3_round2": "the temperature-1.3 control measured on 24 fresh batches (13-36 of runs/study_v4/a2/temp1.3: new "
    "prompts and samples), judged on those alone by R2's rule (estimator sparse-rl, Gamma's lower bound >= 0.10 and "
    "the unclamped gain's lower bound > 0). 'corrections matter': R3 passed. Otherwise R3 failed again: the "
    "control's change of direction is below what K = 24 resolves (a gain of 0.05 at 80% power) and the study "
    "concludes nothing about direction.",
    "R2_round2": "only if R3 round 2 passes: every A2 real sampler re-judged at K = 24 with the unclamped statistic "
    "(extensions first: rkv136, then streaming128, rkv128, rkv112); R4 then reads those verdicts",
    "cpu_hours": "temp1.3's 24 fresh batches about 2.2; each real sampler's extension to 24 about 1.1",
    "first": 12,
    "last": 36,
    "sampler": "temp1.3",
}


def span_coordinates(
    name: str, first: int = 0, last: int = 12, estimators=ESTIMATORS
) -> dict[str, torch.Tensor]:
    """Batches first..last-1 of one sampler's per-batch gradients in coordinates of their span ({estimator:
    [K, R]}): every inner product equals the real one (eigendecomposition of the joint Gram matrix)."""
    files = [batch_path(RUNS / name, k) for k in range(first, last)]
    missing = [f.stem for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"{RUNS / name} lacks batches {', '.join(missing)} of {first}-{last - 1}")
    grads = [torch.load(f, weights_only=True)["grads"] for f in files]
    blocks = gram({e: torch.stack([g[e] for g in grads]) for e in estimators})
    joint = torch.cat([torch.cat([blocks[a, b] for b in estimators], dim=1) for a in estimators])
    values, vectors = torch.linalg.eigh(joint)
    keep = values > values.max() * 1e-12
    coords = vectors[:, keep] * values[keep].sqrt()
    return {e: coords[i * len(files) : (i + 1) * len(files)] for i, e in enumerate(estimators)}


def unbiased_norm(x: torch.Tensor) -> float:
    """||E g|| from the mean of <g_k, g_l> over distinct batches."""
    squared = pair_means(x @ x.T, torch.ones(1, x.shape[0], dtype=torch.float64))
    return math.sqrt(max(float(squared[0]), 0.0))


def truths(coords: dict[str, torch.Tensor], cosines: dict[str, float]) -> dict[str, torch.Tensor]:
    """The known expected gradient of each estimator: dense's committed mean, and for X its committed relative
    norm at the chosen cosine, turned toward its own committed off-dense direction."""
    dense = coords["dense"].mean(0)
    u = dense / dense.norm()
    out = {"dense": dense}
    for e, c in cosines.items():
        off = coords[e].mean(0) - (coords[e].mean(0) @ u) * u
        v = off / off.norm()
        r = unbiased_norm(coords[e]) / unbiased_norm(coords["dense"])
        out[e] = r * dense.norm() * (c * u + math.sqrt(max(1.0 - c * c, 0.0)) * v)
    return out


def simulate(coords, truth, batches: int, replicates: int, draws: int, seed: int) -> dict:
    """Per statistic: the share of replicates whose gain lower bound is > 0 (power or size), and whose c_naive and
    gain intervals hold the truth."""
    gen = torch.Generator().manual_seed(seed)
    k0 = coords["dense"].shape[0]
    dev = {e: coords[e] - coords[e].mean(0) for e in ESTIMATORS}
    u = truth["dense"] / truth["dense"].norm()
    true_c = {e: float(truth[e] @ u / truth[e].norm()) for e in ("naive", "config")}
    true_gain = true_c["config"] - true_c["naive"]
    tally = {
        s: {"gain_low_above_0": 0, "c_naive_covered": 0, "gain_covered": 0} for s in ("clamped", "unclamped")
    }
    for rep in range(replicates):
        z = torch.randn(batches, k0, generator=gen, dtype=torch.float64) / math.sqrt(k0 - 1)
        vectors = {e: truth[e] + z @ dev[e] for e in ESTIMATORS}
        for stat in tally:
            r = gradient_report(vectors, "naive", "dense", draws, seed + rep, clamp=stat == "clamped")
            gain, cn = r["config"]["cosine_gain"], r["naive"]["cosine"]
            t = tally[stat]
            t["gain_low_above_0"] += gain["low"] is not None and gain["low"] > 0
            t["c_naive_covered"] += cn["low"] is not None and cn["low"] <= true_c["naive"] <= cn["high"]
            t["gain_covered"] += gain["low"] is not None and gain["low"] <= true_gain <= gain["high"]
    shares = {s: {k: v / replicates for k, v in t.items()} for s, t in tally.items()}
    return {
        "true_c_naive": true_c["naive"],
        "true_c_config": true_c["config"],
        "true_gain": true_gain,
        **shares,
    }


def judge(points: list[dict], rules: dict) -> dict:
    """I1-I3 from the simulated grid."""
    out = {"calibrated": {}, "resolution": {}}
    for stat in ("clamped", "unclamped"):
        null = [p for p in points if abs(p["true_gain"]) < 1e-9]
        out["calibrated"][stat] = all(p[stat]["gain_low_above_0"] <= 0.10 for p in null) and all(
            p[stat]["c_naive_covered"] >= 0.80 for p in points
        )
        for p in points:
            detected = p["true_gain"] > 1e-9 and p[stat]["gain_low_above_0"] >= 0.80
            key = f"{stat}/{p['noise']}/K{p['batches']}"
            gains = [
                g for g in (out["resolution"].get(key), round(p["true_gain"], 4) if detected else None) if g
            ]
            out["resolution"][key] = min(gains, default=None)
    out["clamp_defect"] = out["calibrated"]["unclamped"] and any(
        p["unclamped"]["gain_low_above_0"] - p["clamped"]["gain_low_above_0"] >= 0.20
        for p in points
        if p["true_gain"] > 1e-9
    )
    out["selected_statistic"] = "unclamped" if out["clamp_defect"] else "clamped"
    sel = out["selected_statistic"]
    out["r3_rejudged_on_fresh_batches"] = (
        out["calibrated"][sel] and out["resolution"][f"{sel}/temp1.3/K12"] is not None
    )
    return out


def round2(state: dict, part: str | None) -> None:
    """R3's second round: the control's fresh batches measured (resumable; `part` I/N: one share of the 36
    batches, in a process beside the others), then judged alone. The pooled K = 36 report is written only where
    batches 1-12's gradients are on this machine too (runs/ is not committed)."""
    import study_v4 as S

    rules = state["instrument_check"]["round2"]["rules"]
    torch.set_num_threads(1)
    name, estimators = rules["sampler"], ESTIMATORS[:2] + ("seq-is", "smd", "dense")
    if part:
        S.run_bias("a2", name, rules["last"], "config,seq-is,smd", [part], write_report=False)
        return
    pooled = all(batch_path(RUNS / name, k).is_file() for k in range(rules["first"]))
    if pooled:
        S.run_bias("a2", name, rules["last"], "config,seq-is,smd")
    coords = span_coordinates(name, rules["first"], rules["last"], estimators)
    report = gradient_report(coords, "naive", "dense", RULES["draws"], seed=0, clamp=False)
    verdicts = {x: verdict(r["gamma"], r["cosine_gain"]) for x, r in report.items() if "gamma" in r}
    state = read(JSON)  # run_bias took minutes to hours: read what is on disk now
    rebuilt = read(S.WARMSTART / "rebuilt.json", None)  # the warm start retrained on this machine, if it was
    state["instrument_check"]["round2"].update(
        estimators=report, verdicts=verdicts, pooled_report=pooled, warmstart_rebuilt=rebuilt
    )
    write(JSON, state)
    print(f"R3 round 2 on batches {rules['first'] + 1}-{rules['last']}: {verdicts}", flush=True)
    S.report(None)  # R3 (and the goals) from the round-2 verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["rules", "run", "round2-rules", "round2"])
    parser.add_argument(
        "--part", default=None, help="round2 only: measure share I/N of its batches (no verdict)"
    )
    args = parser.parse_args()
    state = read(JSON)
    if args.stage == "rules":
        state["instrument_check"] = {"rules": RULES}
    elif args.stage == "round2-rules":
        state["instrument_check"]["round2"] = {"rules": ROUND2}
    elif args.stage == "round2":
        round2(state, args.part)
        return 0
    else:
        rules = state["instrument_check"]["rules"]
        torch.set_num_threads(1)
        points = []
        for noise in rules["noise_sources"]:
            coords = span_coordinates(noise)
            for i, (cn, cc) in enumerate(
                zip(rules["grid"]["c_naive"], rules["grid"]["c_config"], strict=True)
            ):
                truth = truths(coords, {"naive": cn, "config": cc})
                for k in rules["batches"]:
                    p = simulate(coords, truth, k, rules["replicates"], rules["draws"], seed=1000 * i + k)
                    points.append({"noise": noise, "batches": k, **p})
                    print(json.dumps(points[-1]), flush=True)
        state["instrument_check"].update(points=points, judged=judge(points, rules))
        state["instrument_check"]["command"] = "python experiments/study_v4_instrument.py run"
    write(JSON, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
