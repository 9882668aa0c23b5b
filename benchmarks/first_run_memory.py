"""The default run's KV memory line against a dense run of the same config: the sparse run's dense figure
(`kv/dense_kv_bytes`, what `engine.allocation.dense_kv_allocation` says the dense engine allocates for each step's
batch) and the dense run's measured peak (`rollout/peak_kv_bytes` with `algo.preset=dense`), step by step. The
two runs draw the same prompts (the prompt order depends on the seed only), so each step's batch has the same
prompts and lengths caps; the goal is that they agree within 1%.

    python benchmarks/first_run_memory.py                       # the embedded default, 2 steps each, no eval
    python benchmarks/first_run_memory.py --out /tmp/x.json model.spec=tiny-llama   # extra key=value overrides

Writes the goal and the per-step figures into docs/results/first_run.json (section `memory`), keeping the other
goals of that file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine_info, mib, update_result  # noqa: E402

GOAL_NAME = "The default run's dense KV figure agrees with a dense run's measured peak (within 1%)"
GOAL_TARGET = 0.01  # largest relative difference over the steps
COMMAND = "python benchmarks/first_run_memory.py"
DEFAULT_OVERRIDES = [
    "trainer.steps=2",
    "trainer.eval_prompts=0",
    "trainer.threads=1",
    "logging.progress=false",
]


def run(overrides: list[str], out_dir: Path, name: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train one arm; its per-step metric rows and its summary."""
    from sparserl.config import load_config
    from sparserl.trainer import Trainer

    cfg = load_config(None, [*overrides, f"trainer.output_dir={out_dir}", f"trainer.run_name={name}"])
    with Trainer(cfg) as trainer:
        summary = trainer.train()
    lines = (out_dir / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r], summary


def measure(overrides: list[str]) -> dict[str, Any]:
    """Both arms, and per step: the sparse run's peak and dense figure, the dense run's measured peak."""
    from sparserl.trainer.logging import kv_memory_text

    with tempfile.TemporaryDirectory() as tmp:
        sparse, summary = run(overrides, Path(tmp), "sparse")
        dense, dense_summary = run([*overrides, "algo.preset=dense"], Path(tmp), "dense")
    steps = [
        {
            "step": s["step"],
            "sparse_peak_kv_bytes": s["rollout/peak_kv_bytes"],
            "dense_figure_kv_bytes": s["kv/dense_kv_bytes"],
            "naive_per_row_kv_bytes": s["kv/naive_kv_bytes"],
            "dense_run_peak_kv_bytes": d["rollout/peak_kv_bytes"],
            "relative_difference": abs(s["kv/dense_kv_bytes"] / d["rollout/peak_kv_bytes"] - 1),
        }
        for s, d in zip(sparse, dense, strict=True)
    ]
    return {
        "overrides": overrides,
        "memory_line": kv_memory_text(summary),
        "dense_run_memory_line": kv_memory_text(dense_summary),
        "steps": steps,
        "largest_relative_difference": max(s["relative_difference"] for s in steps),
        "machine": machine_info(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of both arms")
    p.add_argument(
        "--out", default=str(RESULTS / "first_run.json"), help="results file (merged, not replaced)"
    )
    args = p.parse_args()
    got = measure([*DEFAULT_OVERRIDES, *args.overrides])
    for s in got["steps"]:
        print(
            f"step {s['step']}: sparse peak {mib(s['sparse_peak_kv_bytes']):.2f} MiB, its dense figure "
            f"{mib(s['dense_figure_kv_bytes']):.2f} MiB, the dense run's peak {mib(s['dense_run_peak_kv_bytes']):.2f} "
            f"MiB (difference {s['relative_difference']:.2%})"
        )
    print(f"memory line: {got['memory_line']}")
    worst = got["largest_relative_difference"]
    goal = {"value": worst, "target": GOAL_TARGET, "met": worst <= GOAL_TARGET, "command": COMMAND}
    update_result(args.out, "memory", got, {GOAL_NAME: goal})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
