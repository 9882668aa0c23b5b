"""Which completion length the default run (`sparserl train`, no arguments) should use: the embedded default
(R-KV budget 80, interval 16) at each candidate `rollout.max_new_tokens`, the whole run as a user gets it (8
steps, the eval before and after), one arm after the other, one thread. Per arm: CPU seconds and wall, the KV
memory line against the dense engine, the training reward curve and the held-out reward before and after.

    python benchmarks/first_run_default.py rules      # write the decision rule (before any arm runs)
    python benchmarks/first_run_default.py run        # every arm not yet measured (~15-30 CPU-minutes each)

The rule (`RULE`) is written into docs/results/first_run.json (section `default_length`) before the arms run;
`run` records each arm as it finishes (re-run it after a kill: measured arms are kept) and then the choice.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine_info, update_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FILE = RESULTS / "first_run.json"
SECTION = "default_length"
COMMAND = "python benchmarks/first_run_default.py run"
CANDIDATES = [64, 128]  # the current default and the shortest length at which budget 80 + 15 saves KV
CPU_LIMIT_S = (
    900.0  # 15 minutes of one thread: the run's wall bound on one core (the default uses every core)
)
GOAL_NAME = "The default run takes <= 15 minutes (CPU seconds at one thread) and visibly learns"
RULE = (
    "Each arm is the default run at its max_new_tokens, one thread, measured in CPU seconds (user + system of "
    "the run's process). An arm qualifies when its CPU seconds are <= 900 and it visibly learns: the held-out "
    "reward after training exceeds the one before. Among qualifying arms choose the one with the largest KV "
    "saving against the dense engine; if none saves, the shortest. If no arm qualifies, keep 64 and record the "
    "goal as not met."
)
BASE = ["trainer.threads=1", "logging.progress=false", "logging.tensorboard=false"]


def section() -> dict[str, Any]:
    return json.loads(FILE.read_text()).get(SECTION, {}) if FILE.is_file() else {}


def write(payload: dict[str, Any], goals: dict[str, Any] | None = None) -> None:
    update_result(FILE, SECTION, payload, goals or {})


def rules(_args: argparse.Namespace) -> None:
    """Write the rule and the candidates before any arm; never rewrite them once arms exist."""
    old = section()
    if old.get("arms"):
        print(f"{FILE.relative_to(ROOT)}: arms measured already; the rule stays as written")
        return
    write({"rule": RULE, "candidates": CANDIDATES, "cpu_limit_s": CPU_LIMIT_S, "arms": {}, "choice": None})
    print(f"rule written to {FILE.relative_to(ROOT)} [{SECTION}]; commit it, then: {COMMAND}")


def run_arm(max_new: int, folder: Path) -> dict[str, Any]:
    """One whole default run in its own process: CPU seconds, wall, and its summary's figures."""
    cmd = [sys.executable, "-m", "sparserl.cli", "train", f"rollout.max_new_tokens={max_new}", *BASE,
           f"trainer.output_dir={folder}", "trainer.run_name=arm"]  # fmt: skip
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    done = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.time() - t0
    if done.returncode:
        raise SystemExit(f"max_new_tokens={max_new}: the run failed:\n{done.stderr[-2000:]}")
    summary = json.loads((folder / "arm" / "summary.json").read_text())
    rows = [json.loads(line) for line in (folder / "arm" / "metrics.jsonl").read_text().splitlines()]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "max_new_tokens": max_new,
        "cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
        "eval_reward_before": summary["eval_reward_before"],
        "eval_reward_after": summary["eval_reward_after"],
        "train_reward_curve": [r["reward/mean"] for r in rows if "reward/mean" in r],
        "kv_saved_fraction": summary["kv_saved_fraction"],
        "peak_kv_bytes_mean": summary["peak_kv_bytes_mean"],
        "dense_kv_bytes_mean": summary["dense_kv_bytes_mean"],
        "rejection_rate_mean": summary["rejection_rate_mean"],
        "memory_line": next((ln for ln in done.stdout.splitlines() if "KV memory" in ln), None),
    }


def qualifies(arm: dict[str, Any]) -> bool:
    return arm["cpu_s"] <= CPU_LIMIT_S and arm["eval_reward_after"] > arm["eval_reward_before"]


def choose(arms: dict[str, dict[str, Any]]) -> tuple[int, bool]:
    """The rule applied: the chosen length and whether the goal is met."""
    ok = [a for a in arms.values() if qualifies(a)]
    if not ok:
        return CANDIDATES[0], False
    saving = max(ok, key=lambda a: (a["kv_saved_fraction"] or 0.0, -a["max_new_tokens"]))
    return saving["max_new_tokens"], True


def run(_args: argparse.Namespace) -> None:
    """Every arm not measured yet, recorded as it finishes; then the choice and the goal."""
    payload = section()
    if not payload.get("rule"):
        raise SystemExit(f"no rule in {FILE.relative_to(ROOT)} yet: run `rules` and commit it first")
    arms = payload["arms"]
    for max_new in CANDIDATES:
        if str(max_new) in arms:
            continue
        print(f"max_new_tokens={max_new} ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            arms[str(max_new)] = run_arm(max_new, Path(tmp))
        print(json.dumps(arms[str(max_new)]), flush=True)
        write({**payload, "arms": arms, "machine": machine_info()})
    chosen, met = choose(arms)
    arm = arms[str(chosen)]
    goal = {GOAL_NAME: {"value": arm["cpu_s"], "target": CPU_LIMIT_S, "met": met, "command": COMMAND,
                        "unit": "CPU seconds of the chosen default's run at one thread"}}  # fmt: skip
    write({**payload, "arms": arms, "choice": chosen, "machine": machine_info()}, goal)
    print(f"chosen: max_new_tokens={chosen} (goal met: {met})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["rules", "run"])
    args = p.parse_args()
    {"rules": rules, "run": run}[args.stage](args)


if __name__ == "__main__":
    main()
