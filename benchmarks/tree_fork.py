"""Tree rollouts that fork their parent's state against independent chains at 4 leaves a prompt, SmolLM2-135M:
rollout CPU seconds per leaf and peak KV bytes per leaf, with the children forked (engine/forks.py) as their
parent finishes, in its run (the local backend `grows_runs`); for comparison, re-prefilled from their prompt and
prefix instead, and forked but decoded in a run of their own after the roots' (a backend that keeps rounds).

    python benchmarks/tree_fork.py     # -> docs/results/reuse.json, section "tree_fork" (~0.3 CPU-hours)

The reuse experiment's tree: 2 roots a prompt, 1 fork point, 1 child (4 leaves), against 4 independent samples;
4 prompts of the default task, dense rollouts (algo.preset=dense), temperature 1, one thread, at 64 and 256 new
tokens. One step's `collect_step` per arm, the arms alternating, `--repeats` rounds; medians of CPU seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from _common import command_line, machine_info, update_result

from sparserl.signals import stoppable

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "reuse.json"
TREE = ["rollout.n=2", "rollout.tree.enable=true", "rollout.tree.forks=1", "rollout.tree.children=1"]
ARMS = {"tree": TREE, "tree-reprefill": TREE, "tree-rounds": TREE, "chains": ["rollout.n=4"]}
LENGTHS = (64, 256)
SPEED_TARGET = 0.8  # tree seconds per leaf over chains'


def collect(name: str, length: int, seed: int, out: Path) -> dict:
    """One step of arm `name` at `length` new tokens: leaves, CPU seconds, peak KV bytes, tokens generated and
    the decode steps that generated them (a child decodes after its parent ends, in its run or in a second
    one: each step reads every weight once however few rows it runs)."""
    from sparserl.config import load_config
    from sparserl.trainer import Trainer

    cfg = load_config(None, [
        "algo.preset=dense", "rollout.prompts_per_step=4", f"rollout.max_new_tokens={length}",
        f"trainer.seed={seed}", "trainer.threads=1", "trainer.eval_prompts=0", "logging.progress=false",
        "logging.tensorboard=false", "engine.compile=false", f"trainer.output_dir={out}",
        f"trainer.run_name={name}-{length}-{seed}-{time.time_ns()}", *ARMS[name],
    ])  # fmt: skip
    with Trainer(cfg) as trainer:
        backend = trainer.rollouts.backend
        if name == "tree-reprefill":  # the children prefill their prompt and prefix, as before forks
            run = backend.run

            def without_forks(requests, *a, **k):
                for r in requests:
                    r.fork_of = None
                return run(requests, *a, **k)

            backend.run = without_forks
        if name == "tree-rounds":  # the children wait for the roots' run to end, then run in one of their own
            backend.grows_runs = False
        c0 = time.process_time()
        got = trainer.rollouts.collect_step(trainer.source, 4, 0, trainer.state.engine_seed)
        cpu = time.process_time() - c0
    leaves = sum(len(g.samples) for g in got.groups)
    return {"leaves": leaves, "cpu_s": cpu, "cpu_s_per_leaf": cpu / leaves,
            "peak_kv_bytes_per_leaf": got.metrics["peak_kv_bytes"] / leaves,
            "generated_tokens": got.sampling["generated_tokens"],
            "decode_steps": got.metrics["decode_steps"]}  # fmt: skip


def cost_split(runs: dict[str, list[dict]]) -> dict:
    """Least squares over every run: CPU seconds = a x decode steps + b x generated tokens + c (a: what a step
    costs however many rows it runs, chiefly reading the weights; b: what each row adds)."""
    import torch

    rows = [r for v in runs.values() for r in v]
    x = torch.tensor([[r["decode_steps"], r["generated_tokens"], 1.0] for r in rows], dtype=torch.float64)
    y = torch.tensor([[r["cpu_s"]] for r in rows], dtype=torch.float64)
    a, b, c = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    resid = (y - x @ torch.tensor([[a], [b], [c]], dtype=torch.float64)).abs().max().item()
    return {"per_decode_step_s": a, "per_generated_token_s": b, "constant_s": c, "max_abs_residual_s": resid,
            "runs": len(rows)}  # fmt: skip


@stoppable("benchmarks/tree_fork.py", "the measurement; re-run it", exits=True)
def main() -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "tree_fork")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {f"{a}@{n}": [] for n in LENGTHS for a in ARMS}
    for r in range(args.repeats):
        for n in LENGTHS:
            for name in ARMS if r % 2 == 0 else list(ARMS)[::-1]:
                runs[f"{name}@{n}"].append(collect(name, n, r, args.out))
                print(f"round {r} {name}@{n}: {runs[f'{name}@{n}'][-1]}", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    cmd = command_line()
    goals = {}
    for n in LENGTHS:
        tree, chains = med[f"tree@{n}"], med[f"chains@{n}"]
        speed = tree["cpu_s_per_leaf"] / chains["cpu_s_per_leaf"]
        kv = tree["peak_kv_bytes_per_leaf"] / chains["peak_kv_bytes_per_leaf"]
        goals[f"Trees at 4 leaves, {n} new tokens: rollout seconds per leaf <= 0.8x independent chains'"] = {
            "value": round(speed, 3),
            "target": SPEED_TARGET,
            "met": speed <= SPEED_TARGET,
            "command": cmd,
        }
        goals[f"Trees at 4 leaves, {n} new tokens: peak KV per leaf below independent chains'"] = {
            "value": round(kv, 3), "target": 1.0, "met": kv < 1.0, "command": cmd}  # fmt: skip
    payload = {"medians": med, "runs": runs, "arms": ARMS, "cost_split": cost_split(runs), "command": cmd,
               "machine": machine_info()}  # fmt: skip
    update_result(OUT, "tree_fork", payload, goals)
    for k, v in med.items():
        print(k, {m: round(x, 4) for m, x in v.items()})
    return med


if __name__ == "__main__":
    main()
    sys.exit(0)
