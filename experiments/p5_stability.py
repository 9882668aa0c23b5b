"""Does alpha's tail stay put during RL? Sparrow's central finding is that the P5 of the acceptance rate depends
on model, budget and length but hardly on the RL iteration, which is what lets a schedule be calibrated once.

1. Train SmolLM2-135M with `block_topk` rollouts: the embedded default run (configs/default.yaml: LoRA,
   one-digit sums, where the base model earns reward, so the policy moves) at a budget of 64 positions read
   (4 pages of the ~80-140 a sequence holds), 20 steps, checkpoints every 10, alpha logged during training.
   (long_arithmetic, whose prompts reach several bins, gives the base model no reward at all, so RL on it
   would not move the policy.)
2. Calibrate (`sparserl calibrate`, exact alpha) the base model (step 0) and the step-10 and step-20
   checkpoints, each with `--seeds` sampling seeds, on the same long_arithmetic prompt as the committed
   schedule (422 prompt tokens + 512 new: positions in bins 256-511, 512-767 and 768-1023) at budgets 128 and
   256, the two that bracket tau there.
3. Per (budget, length bin): how far the seed-mean P5 moves across the checkpoints (its range) against the
   seed-to-seed spread (the range of P5 over the seeds, averaged over the checkpoints). Written to
   docs/results/p5_stability/ (p5_stability.json with the goal, p5_stability.png; each calibration under
   calibrations/).

    python experiments/p5_stability.py                # run or resume every part, then the report
    python experiments/p5_stability.py --report-only  # the report, running only missing calibrations

A finished part is not run again: training resumes from its last checkpoint, a calibration whose
calibration.json exists is kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from study import ROOT, plain, read_metrics, train_arm, write_atomic

from sparserl.signals import stoppable
from sparserl.trainer import checkpoint_path

CONFIG = ROOT / "configs" / "default.yaml"
RUN_NAME = "stability-block_topk"
TRAIN = [
    "kv.method=block_topk", "kv.budget=64", "trainer.steps=20", "trainer.save_every=10",
    "trainer.keep_last=3", "trainer.eval_prompts=0", "trainer.log_acceptance=true", "trainer.acceptance_bin=64",
]  # fmt: skip
STEPS = (0, 10, 20)  # step 0 is the base model
CALIBRATE = [
    "--data", "long_arithmetic", "--split", "test", "--prompts", "1", "--offset", "0", "--method", "block_topk",
    "--budgets", "128,256", "--n", "4", "--max-new-tokens", "512", "--bin-width", "256", "--ignore-eos",
]  # fmt: skip
RESULTS = ROOT / "docs" / "results" / "p5_stability"


def model_at(run: Path, step: int) -> str:
    return "smollm2-135m" if step == 0 else str(checkpoint_path(run, step))


def calibrate(run: Path, step: int, seed: int, threads: int) -> Path:
    """One calibration of the model at `step` with sampling seed `seed` (skipped when already there)."""
    out = RESULTS / "calibrations" / f"step-{step}-seed-{seed}"
    if not (out / "calibration.json").is_file():
        cmd = ["sparserl", "calibrate", "--model", model_at(run, step), *CALIBRATE, "--seed", str(seed)]
        cmd += ["--out", str(out.relative_to(ROOT)), "--threads", str(threads), "--quiet"]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode:
            raise SystemExit(f"calibration of step {step}, seed {seed} failed (its error is above)")
    return out / "calibration.json"


def p5_table(path: Path) -> dict[tuple[int, int], float]:
    """(budget, bin start) -> P5 of one calibration, for the bins with enough tokens."""
    cal = json.loads(path.read_text())
    return {
        (row["budget"], b["start"]): b["p5"]
        for row in cal["table"]
        for b in row["bins"]
        if b["p5"] is not None
    }


def spread(values: list[float]) -> float:
    return max(values) - min(values)


def stability(tables: dict[tuple[int, int], dict]) -> list[dict]:
    """Per (budget, bin) cell measured in every calibration: the seed-mean P5 per step, its range over the
    steps (the movement) and the range over seeds averaged over the steps (the seed-to-seed spread)."""
    steps, seeds = sorted({s for s, _ in tables}), sorted({k for _, k in tables})
    cells = sorted(set.intersection(*(set(t) for t in tables.values())))
    rows = []
    for cell in cells:
        per_step = {s: [tables[s, k][cell] for k in seeds] for s in steps}
        means = {s: statistics.fmean(v) for s, v in per_step.items()}
        movement, noise = spread(list(means.values())), statistics.fmean(spread(v) for v in per_step.values())
        rows.append({
            "budget": cell[0], "bin_start": cell[1], "p5_by_step": per_step, "mean_by_step": means,
            "movement": movement, "seed_spread": noise, "ratio": movement / noise if noise > 0 else None,
        })  # fmt: skip
    return rows


def training_alpha(run: Path) -> list[dict]:
    """The alpha metrics the training run logged per step (trainer.log_acceptance)."""
    return [{k: v for k, v in m.items() if k == "step" or k.startswith("alpha/")} for m in read_metrics(run)]


def plot(rows: list[dict], tau: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["budget"] for r in rows})
    fig, axes = plt.subplots(1, len(budgets), figsize=(5 * len(budgets), 3.8), sharey=True, squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        for r in (r for r in rows if r["budget"] == budget):
            steps = sorted(r["p5_by_step"])
            ax.errorbar(
                steps, [r["mean_by_step"][s] for s in steps], capsize=3, marker="o",
                yerr=[[r["mean_by_step"][s] - min(r["p5_by_step"][s]) for s in steps],
                      [max(r["p5_by_step"][s]) - r["mean_by_step"][s] for s in steps]],
                label=f"positions {r['bin_start']}-{r['bin_start'] + 255}",
            )  # fmt: skip
        ax.axhline(tau, color="grey", linestyle="--", linewidth=1, label=f"tau {tau}")
        ax.set(title=f"block_topk budget {budget}", xlabel="RL step (checkpoint)", xticks=STEPS)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P5 of alpha (seed mean; bars: seed range)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(run: Path, seeds: list[int], threads: int) -> dict:
    paths = {(s, k): calibrate(run, s, k, threads) for s in STEPS for k in seeds}
    tables = {key: p5_table(path) for key, path in paths.items()}
    rows = stability(tables)
    tau = json.loads(next(iter(paths.values())).read_text())["settings"]["tau"]
    worst = max((r["ratio"] for r in rows if r["ratio"] is not None), default=None)
    command = f"python experiments/p5_stability.py --seeds {','.join(map(str, seeds))}"
    result = {
        "experiment": "P5 of alpha across RL checkpoints of a block_topk run vs its seed-to-seed spread",
        "command": command,
        "train": {
            "config": str(CONFIG.relative_to(ROOT)),
            "overrides": TRAIN,
            "run": str(run.relative_to(ROOT)),
        },
        "calibrate": CALIBRATE,
        "steps": list(STEPS),
        "seeds": seeds,
        "tau": tau,
        "definitions": "movement: range over steps of the seed-mean P5; seed_spread: range over the sampling "
        "seeds of P5, averaged over the steps; ratio = movement / seed_spread",
        "goals": {
            "Stability: P5 moves by less than its seed-to-seed spread across the RL checkpoints (max ratio < 1)": {
                "value": worst,
                "target": 1.0,
                "met": worst is not None and worst < 1.0,
                "command": command,
            }
        },
        "cells": rows,
        "training_alpha": training_alpha(run),
    }
    write_atomic(RESULTS / "p5_stability.json", json.dumps(result, indent=2, default=plain) + "\n")
    plot(rows, tau, RESULTS / "p5_stability.png")
    for r in rows:
        print(f"budget {r['budget']:>4} bin {r['bin_start']:>4}: movement {r['movement']:.3f}, "
              f"seed spread {r['seed_spread']:.3f}")  # fmt: skip
    print(f"max movement / spread: {worst}; wrote {RESULTS / 'p5_stability.json'}")
    return result


@stoppable("experiments/p5_stability.py", "finished parts are kept; run the same command to go on")
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="calibration sampling seeds (default 0,1,2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="no training: the report, running only missing calibrations",
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    run = ROOT / "runs" / RUN_NAME
    if not args.report_only:
        train_arm(ROOT / "runs", RUN_NAME, TRAIN, [f"trainer.threads={args.threads}"], config=CONFIG)
    report(run, seeds, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
