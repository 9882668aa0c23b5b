"""Overlapped steps (`rollout.overlap.enable=true`) against the same run without, on the embedded default config.

    python benchmarks/overlap.py speed       # off/on alternating, 2 repeats, 4 steps each, all cores (~15 min)
    python benchmarks/overlap.py speed --set trainer.malloc_mmap_threshold=0 --section glibc_threshold
    python benchmarks/overlap.py learning    # 3 seeds paired, whole default runs (~2 CPU-hours; rule in the JSON)
                                             # (each run's training reward and held-out curve kept beside it)

`speed`: each run is `sparserl train` in its own process (torch's default threads: overlapped, half each to
the sampler and the learner), seconds per step = the median over steps 2-4 of every repeat (step 1 has no
rollout drawn ahead); CPU seconds beside wall; the trainer process's peak RSS (`wait4`'s ru_maxrss) per arm,
which is also the memory goal's figure (docs/results/memory.json). `learning`: the rule below, written into
docs/results/overlap.json before any learning run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine_info, update_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OVERLAP_JSON, MEMORY_JSON = RESULTS / "overlap.json", RESULTS / "memory.json"
ARMS = {"off": [], "on": ["rollout.overlap.enable=true"]}
SPEED = ["trainer.steps=4", "trainer.eval_prompts=0", "logging.progress=false", "logging.tensorboard=false"]
SPEED_GOAL = "The default sparserl train with overlap: wall seconds per step, off over on (>= 1.4)"
MEMORY_GOAL = "Peak RSS of the default sparserl train, with and without overlap (<= 2.0 GB)"
LEARNING_GOAL = "Overlap on vs off, 3 seeds paired, final held-out reward: non-inferior within 0.05"
LEARNING_RULE = (
    "Arms off and on, seeds 0, 1, 2, each the whole default run (8 steps, the eval before and after on 32 held-out "
    "prompts), one process per run. d_s = on - off of the final held-out reward (eval/dense/reward after "
    "training) for seed s. Overlap is non-inferior when the one-sided 95% lower bound of mean(d) (paired t, df = "
    "2: mean - 2.920 * sd / sqrt(3)) is above -0.05, the margin fixed here before any run; else not shown."
)


def run(overrides: list[str], folder: Path) -> dict[str, Any]:
    """One `sparserl train` in its own process: per-step wall and CPU seconds, the process's peak RSS."""
    cmd = [sys.executable, "-m", "sparserl.cli", "train", *overrides, f"trainer.output_dir={folder}",
           "trainer.run_name=arm"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the default: every core
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(overrides)}: the run failed:\n{err[-2000:]}")
    rows = [json.loads(x) for x in (folder / "arm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    return {"wall_s": round(time.time() - t0, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "step_s": [r["time/step"] for r in steps],
            "step_cpu_s": [r["time/step_cpu"] for r in steps],
            "phases_s": [{k: r.get(f"time/{k}") for k in ("rollout", "score", "train")} for r in steps],
            "final": next((r for r in reversed(rows) if "eval/dense/reward" in r), {}).get("eval/dense/reward"),
            "curve": [{"step": r["step"], "reward_mean": r.get("reward/mean")} for r in steps],
            "held_out": [{"step": r.get("step"), "reward": r["eval/dense/reward"]} for r in rows
                         if "eval/dense/reward" in r]}  # fmt: skip


def speed(args: argparse.Namespace) -> None:
    """Off and on alternating, `--repeats` times; the ratio of their median seconds per step (steps 2-4)."""
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        for arm, keys in ARMS.items():
            with tempfile.TemporaryDirectory() as tmp:
                runs[arm].append(run([*SPEED, *args.set, *keys], Path(tmp)))
            print(f"repeat {repeat} {arm}: {json.dumps(runs[arm][-1])}", flush=True)
    per_step = {arm: statistics.median(s for r in rs for s in r["step_s"][1:]) for arm, rs in runs.items()}
    cpu = {arm: statistics.median(s for r in rs for s in r["step_cpu_s"][1:]) for arm, rs in runs.items()}
    rss = {arm: max(r["peak_rss_bytes"] for r in rs) for arm, rs in runs.items()}
    ratio = per_step["off"] / per_step["on"]
    command = "python benchmarks/overlap.py speed" + "".join(f" --set {kv}" for kv in args.set)
    payload = {"settings": SPEED + args.set, "arms": ARMS, "runs": runs, "median_step_s": per_step,
               "median_step_process_cpu_s": cpu, "off_over_on": ratio, "machine": machine_info(), "command": command}  # fmt: skip
    if args.set:  # not the default run: its own section, no goal
        update_result(OVERLAP_JSON, f"speed_{args.section}", payload | {"peak_rss_bytes": rss}, {})
        print(f"seconds per step: off {per_step['off']:.1f}, on {per_step['on']:.1f} (off/on {ratio:.2f})")
        return
    update_result(OVERLAP_JSON, "speed", payload, {SPEED_GOAL: {"value": round(ratio, 3), "target": 1.4,
                  "met": ratio >= 1.4, "command": command}})  # fmt: skip
    worst = max(rss.values()) / 1e9
    update_result(MEMORY_JSON, "default_train", {"peak_rss_bytes": rss, "settings": SPEED, "machine": machine_info()},
                  {MEMORY_GOAL: {"value": round(worst, 3), "target": 2.0, "met": worst <= 2.0, "command": command,
                                 "unit": "GB, the larger of the two arms' trainer-process peak RSS"}})  # fmt: skip
    print(f"seconds per step: off {per_step['off']:.1f}, on {per_step['on']:.1f} (off/on {ratio:.2f}); "
          f"peak RSS GB: {', '.join(f'{a} {b / 1e9:.2f}' for a, b in rss.items())}")  # fmt: skip


def learning_verdict(runs: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The goal, and the differences with their lower bound, from the runs recorded: judged once every (seed, arm)
    has a final held-out reward (a run made again for its curves keeps its first final until it ends)."""
    goal = {LEARNING_GOAL: {"value": None, "target": -0.05, "met": None, "status": "not run yet",
                            "command": "python benchmarks/overlap.py learning"}}  # fmt: skip
    if not all(f"{arm}/{s}" in runs for arm in ARMS for s in (0, 1, 2)):
        return goal, {}
    d = [runs[f"on/{s}"]["final"] - runs[f"off/{s}"]["final"] for s in (0, 1, 2)]
    lower = statistics.mean(d) - 2.920 * statistics.stdev(d) / math.sqrt(3)
    goal[LEARNING_GOAL] |= {"value": round(lower, 4), "met": lower > -0.05, "status": "measured"}
    return goal, {"differences": d, "lower_bound": lower}


def learning(args: argparse.Namespace) -> None:
    """The rule first (kept once written); then each (seed, arm) run not recorded yet, or recorded without its
    curves (run again: the same seed, its first final kept beside); the verdict after each run."""
    old = json.loads(OVERLAP_JSON.read_text()).get("learning", {}) if OVERLAP_JSON.is_file() else {}
    runs = old.get("runs", {})
    payload = {"rule": LEARNING_RULE, "margin": -0.05, "seeds": [0, 1, 2]}
    if not old:
        update_result(OVERLAP_JSON, "learning", {**payload, "runs": runs}, learning_verdict(runs)[0])
        print("rule written: commit it before the runs")
        if args.rule_only:
            return
    for seed in (0, 1, 2):
        for arm, keys in ARMS.items():
            earlier = runs.get(f"{arm}/{seed}", {})
            if "curve" in earlier:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                done = run([f"trainer.seed={seed}", "logging.progress=false", *keys], Path(tmp))
            runs[f"{arm}/{seed}"] = done | (
                {"final_of_the_run_without_curves": earlier["final"]} if earlier else {}
            )
            goal, verdict = learning_verdict(runs)
            update_result(OVERLAP_JSON, "learning", {**payload, "runs": runs, **verdict}, goal)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["speed", "learning"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rule-only", action="store_true", help="learning: write the rule and stop")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="speed: an override for both arms (repeatable); written to section speed_SECTION, no goal",
    )
    p.add_argument("--section", default="with_settings", help="speed with --set: the section's suffix")
    args = p.parse_args()
    {"speed": speed, "learning": learning}[args.stage](args)


if __name__ == "__main__":
    main()
