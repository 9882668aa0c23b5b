"""Rollout throughput of the `ray` backend (1 and 2 workers, one thread each) against the in-process backend, and
the weight-push time, on SmolLM2-135M.

    python benchmarks/ray_rollout.py            # -> docs/results/ray.json (~0.1 CPU-hours; needs both cores)

One batch (the default config's task: 8 prompts x 8 samples, 64 new tokens, dense) is decoded by each arm in turn,
arms alternating, `--repeats` times; wall seconds and generated tokens per second are kept per run, medians and
ratios reported. The push is timed for the full model in float32 and bfloat16 and for a LoRA adapter (r 16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import update_result

from sparserl.signals import stoppable

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "ray.json"
COMMAND = "python benchmarks/ray_rollout.py"
ARMS = {"in_process": 0, "ray_1_worker": 1, "ray_2_workers": 2}


def build(workers: int, lora: bool, out: Path):
    from sparserl.config import load_config
    from sparserl.trainer import Trainer

    cfg = load_config(None, [
        "algo.preset=dense", "rollout.prompts_per_step=8", "rollout.n=8", f"model.lora={str(lora).lower()}",
        f"distributed.rollout_workers={workers}", "trainer.threads=1", "trainer.eval_prompts=0",
        "logging.progress=false", "logging.tensorboard=false", f"trainer.output_dir={out}",
        f"trainer.run_name=w{workers}-lora{lora}-{time.time_ns()}", "engine.compile=false",
    ])  # fmt: skip
    return Trainer(cfg)


def time_rollout(trainer, plans) -> dict:
    t0 = time.perf_counter()
    got = trainer.rollouts.collect(0, 7, plans)
    wall = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for g in got.groups for s in g.samples)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def time_push(trainer, dtype) -> float:
    from sparserl.rollout.ray_backend import trainable_state

    state = {k: v.to(dtype) for k, v in trainable_state(trainer.policy.module).items()}
    t0 = time.perf_counter()
    trainer.rollouts.backend.push_weights(0, state)
    return time.perf_counter() - t0


@stoppable("benchmarks/ray_rollout.py", "the measurement; re-run it", exits=True)
def main() -> dict:
    import ray
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ray_bench")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # 3 logical CPUs for the 1- and 2-worker arms' actors to exist side by side; arms run one at a time, so
    # at most 2 workers (the 2 cores) compute at once
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    trainers = {arm: build(w, False, args.out) for arm, w in ARMS.items()}
    plans = trainers["in_process"].source.plan(8, 0)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):  # arms alternate
        for arm, trainer in trainers.items():
            runs[arm].append(time_rollout(trainer, plans))
    med = {arm: statistics.median(r["tokens_per_s"] for r in rs) for arm, rs in runs.items()}
    pushes = {
        "full_float32_s": statistics.median(
            time_push(trainers["ray_1_worker"], torch.float32) for _ in range(3)
        ),
        "full_bfloat16_s": statistics.median(
            time_push(trainers["ray_1_worker"], torch.bfloat16) for _ in range(3)
        ),
    }
    for t in trainers.values():
        t.close()
    lora = build(1, True, args.out)
    pushes["lora_adapter_s"] = statistics.median(time_push(lora, torch.float32) for _ in range(3))
    lora.close()
    two, one = med["ray_2_workers"] / med["ray_1_worker"], med["ray_1_worker"] / med["in_process"]
    goals = {
        "2 rollout workers >= 1.8x the throughput of 1 worker (one thread each)": {
            "value": two, "target": 1.8, "met": two >= 1.8, "command": COMMAND},
        "Ray backend with 1 worker >= 0.9x the in-process backend's throughput": {
            "value": one, "target": 0.9, "met": one >= 0.9, "command": COMMAND},
        "Weight push of SmolLM2-135M in bfloat16 <= 3 s": {
            "value": pushes["full_bfloat16_s"], "target": 3.0, "met": pushes["full_bfloat16_s"] <= 3.0,
            "command": COMMAND},
        "Weight push of a LoRA adapter <= 0.3 s": {
            "value": pushes["lora_adapter_s"], "target": 0.3, "met": pushes["lora_adapter_s"] <= 0.3,
            "command": COMMAND},
    }  # fmt: skip
    result = {"tokens_per_s_median": med, "runs": runs, "push_s": pushes, "cpu_threads": 1,
              "batch": "8 prompts x 8 samples, 64 new tokens, dense, SmolLM2-135M fp32"}  # fmt: skip
    update_result(OUT, "throughput", result, goals)
    print(json.dumps({"goals": goals, **result}, indent=1))
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
