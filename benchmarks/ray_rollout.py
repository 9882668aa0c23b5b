"""Rollout throughput of the `ray` backend (1 and 2 workers, one thread each) against the in-process backend, and
the weight-push time, on SmolLM2-135M.

    python benchmarks/ray_rollout.py            # -> docs/results/ray.json (~0.1 CPU-hours; needs both cores)
    python benchmarks/ray_rollout.py --pushes   # the push times of both weight syncs only (section `pushes`)

One batch (the default config's task: 8 prompts x 8 samples, 64 new tokens, dense) is decoded by each arm in turn,
arms alternating, `--repeats` times; wall seconds and generated tokens per second are kept per run, medians and
ratios reported. The arm `two_processes` decodes the same batch in two halves in two plain processes side by
side (no Ray): what two one-thread decoders get from this machine, the ceiling the 2-worker goal meets. The
push is timed for the full model in float32 and bfloat16 and for a LoRA adapter (r 16), through the object
store (the goals); `--pushes` times it through each `distributed.weight_sync` (1 worker,
median of `--repeats`, each push's CPU seconds of this process beside its wall seconds).
"""

from __future__ import annotations

import argparse
import contextlib
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


def build(workers: int, lora: bool, out: Path, sync: str = "object_store"):
    from sparserl.config import load_config
    from sparserl.trainer import Trainer

    cfg = load_config(None, [
        "algo.preset=dense", "rollout.prompts_per_step=8", "rollout.n=8", f"model.lora={str(lora).lower()}",
        f"distributed.rollout_workers={workers}", *([f"distributed.weight_sync={sync}"] if workers else []),
        "trainer.threads=1",
        "trainer.eval_prompts=0",
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


def _half_worker(conn, out: Path) -> None:
    """A plain process (no Ray) holding its own in-process trainer at one thread: decodes the plans it is sent
    and answers with its wall seconds and tokens, until sent None."""
    import torch

    torch.set_num_threads(1)
    trainer = build(0, False, out)
    conn.send("ready")
    while (plans := conn.recv()) is not None:
        conn.send(time_rollout(trainer, plans))
    trainer.close()


class TwoProcesses:
    """The control arm for the 2-worker goal: the batch split in two halves (the 2 workers' split, 4 groups
    each) decoded by two plain processes side by side, so that what the machine itself gives two one-thread
    decoders is measured apart from what Ray costs."""

    def __init__(self, out: Path) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_half_worker, args=(child, out), daemon=True)
            proc.start()
            child.close()  # the child's end lives in the child only: its death reads as EOF here
            self.pipes.append(parent)
            self.procs.append(proc)
        for conn, proc in zip(self.pipes, self.procs, strict=True):
            self._receive(conn, proc)  # built: the model loads are not timed

    @staticmethod
    def _receive(conn, proc, timeout_s: float = 600.0):
        """The child's answer, or an error naming it when it died or went silent for `timeout_s`."""
        waited = 0.0
        while not conn.poll(5.0):
            waited += 5.0
            if not proc.is_alive() or waited >= timeout_s:
                raise RuntimeError(f"two_processes: decoder process {proc.pid} died or did not answer")
        return conn.recv()

    def rollout(self, plans) -> dict:
        half = len(plans) // 2
        t0 = time.perf_counter()
        for conn, part in zip(self.pipes, (plans[:half], plans[half:]), strict=True):
            conn.send(part)
        answers = [self._receive(conn, proc) for conn, proc in zip(self.pipes, self.procs, strict=True)]
        wall = time.perf_counter() - t0
        tokens = sum(a["tokens"] for a in answers)
        return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}

    def close(self) -> None:
        for conn, proc in zip(self.pipes, self.procs, strict=True):
            with contextlib.suppress(OSError):
                conn.send(None)
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()


def time_push(trainer, dtype) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds of one push of the trainable tensors in `dtype`."""
    from sparserl.distributed.weights import trainable_state

    state = {k: v.to(dtype) for k, v in trainable_state(trainer.policy.module).items()}
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.rollouts.backend.push_weights(0, state)
    return time.perf_counter() - t0, time.process_time() - c0


def push_times(out: Path, sync: str, repeats: int) -> dict[str, float]:
    """Median push seconds (wall; `_cpu` keys: this process's CPU, of the same pushes) of 1 worker: full fp32,
    full bf16, LoRA."""
    import torch

    times: dict[str, float] = {}
    for lora, dtypes in ((False, (torch.float32, torch.bfloat16)), (True, (torch.float32,))):
        trainer = build(1, lora, out, sync)
        time_push(trainer, torch.float32)  # the first push forms a broadcast group: outside the timings
        for dtype in dtypes:
            key = "lora_adapter" if lora else f"full_{str(dtype).removeprefix('torch.')}"
            walls, cpus = zip(*(time_push(trainer, dtype) for _ in range(repeats)), strict=True)
            times[f"{key}_s"], times[f"{key}_cpu_s"] = statistics.median(walls), statistics.median(cpus)
        trainer.close()
    return times


def pushes_only(out: Path, repeats: int) -> None:
    """Section `pushes`: each weight sync's push times, syncs alternating `repeats` times (no goals change)."""
    rounds = [
        {sync: push_times(out, sync, 3) for sync in ("object_store", "broadcast")} for _ in range(repeats)
    ]
    result = {
        sync: {k: statistics.median(r[sync][k] for r in rounds) for k in rounds[0][sync]}
        for sync in rounds[0]
    }
    result |= {"rounds": rounds, "cpu_threads": 1, "workers": 1, "command": f"{COMMAND} --pushes"}
    update_result(OUT, "pushes", result, {})
    print(json.dumps(result, indent=1))


@stoppable("benchmarks/ray_rollout.py", "the measurement; re-run it", exits=True)
def main() -> dict:
    import ray
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ray_bench")
    parser.add_argument("--pushes", action="store_true", help="only the push times of each weight sync")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # 3 logical CPUs for the 1- and 2-worker arms' actors to exist side by side; arms run one at a time, so
    # at most 2 workers (the 2 cores) compute at once
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    if args.pushes:
        pushes_only(args.out, args.repeats)
        ray.shutdown()
        return {}
    trainers = {arm: build(w, False, args.out) for arm, w in ARMS.items()}
    plans = trainers["in_process"].source.plan(8, 0)
    control = TwoProcesses(args.out)
    runs: dict[str, list[dict]] = {arm: [] for arm in [*ARMS, "two_processes"]}
    try:
        for _ in range(args.repeats):  # arms alternate
            for arm, trainer in trainers.items():
                runs[arm].append(time_rollout(trainer, plans))
            runs["two_processes"].append(control.rollout(plans))
    finally:
        control.close()
    med = {arm: statistics.median(r["tokens_per_s"] for r in rs) for arm, rs in runs.items()}
    for t in trainers.values():
        t.close()
    pushes = push_times(args.out, "object_store", 3)
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
              "two_processes_vs_in_process": med["two_processes"] / med["in_process"],
              "ray_2_workers_vs_two_processes": med["ray_2_workers"] / med["two_processes"],
              "batch": "8 prompts x 8 samples, 64 new tokens, dense, SmolLM2-135M fp32"}  # fmt: skip
    update_result(OUT, "throughput", result, goals)
    print(json.dumps({"goals": goals, **result}, indent=1))
    ray.shutdown()
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
