"""Rollout workers killed at random during rollouts: does every run still deliver exactly its samples?

    python benchmarks/ray_kills.py --kills 20      # -> docs/results/ray.json, section "kills" (~0.1 CPU-hours)

A tiny random model with 2 rollout workers on a local 2-CPU Ray. A reference rollout is decoded without faults;
then each trial decodes the same plans while a timer kills one worker's process (SIGKILL) after a random delay
within the reference's duration. Checked per trial against the reference: every expected sample is there once
(none lost, none duplicated), each with the reference's tokens (none drawn with other weights or another stream),
and at the policy version asked for (none stale).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import update_result

from sparserl.signals import stoppable

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "ray.json"
COMMAND = "python benchmarks/ray_kills.py --kills 20"


def samples_of(got) -> tuple[dict[tuple[int, int], tuple[tuple[int, ...], set[int]]], int]:
    """(seed, key) -> (tokens, versions) of every delivered sample, and how many were delivered twice."""
    out, duplicated = {}, 0
    for s in (s for g in got.groups for s in g.samples):
        duplicated += (s.seed, s.key) in out
        out[s.seed, s.key] = (tuple(s.tokens), set(s.versions))
    return out, duplicated


def kill_later(backend, delay: float, rng: random.Random, delivered: list[int]) -> threading.Thread:
    """SIGKILL one live worker's process after `delay` seconds (a worker busy with its share included);
    `delivered` gets the pid killed (a worker killed at an earlier trial and not yet replaced is skipped)."""

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False

    def kill() -> None:
        time.sleep(delay)
        live = [pid for pid in backend.pids if alive(pid)]
        if live:
            pid = rng.choice(live)
            os.kill(pid, signal.SIGKILL)
            delivered.append(pid)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@stoppable("benchmarks/ray_kills.py", "the trials; re-run them", exits=True)
def main() -> dict:
    import ray

    from sparserl.config import load_config
    from sparserl.trainer import Trainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.test_trainer import ParityTask

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [
            "model.spec=tiny-llama", "model.lora=false", "rollout.prompts_per_step=8", "rollout.n=4",
            "rollout.max_new_tokens=96", "distributed.rollout_workers=2", "trainer.eval_prompts=0",
            "logging.progress=false", "logging.tensorboard=false", f"trainer.output_dir={tmp}",
        ])  # fmt: skip
        with Trainer(cfg, task=ParityTask(), eval_task=ParityTask()) as trainer:
            plans = trainer.source.plan(8, 0)
            t0 = time.perf_counter()
            reference, _ = samples_of(trainer.rollouts.collect(0, 7, plans))
            duration = time.perf_counter() - t0
            trials, delivered = [], []
            for _ in range(args.kills):
                before = trainer.rollouts.backend.restarts
                thread = kill_later(trainer.rollouts.backend, rng.uniform(0, duration), rng, delivered)
                got, duplicated = samples_of(trainer.rollouts.collect(0, 7, plans))
                thread.join()
                trials.append({
                    "restarted": trainer.rollouts.backend.restarts - before, "duplicated": duplicated,
                    "lost": len(reference.keys() - got.keys()),
                    "extra": len(got.keys() - reference.keys()),
                    "different_tokens": sum(got[k][0] != reference[k][0] for k in reference.keys() & got.keys()),
                    "stale": sum(v != {0} for _, v in got.values()),
                })  # fmt: skip
            # a kill that came after its worker's share was done is repaired at the next rollout: one more
            final, duplicated = samples_of(trainer.rollouts.collect(0, 7, plans))
            repaired = trainer.rollouts.backend.restarts
            final_ok = final == reference and not duplicated
    ray.shutdown()
    bad = sum(t["lost"] + t["extra"] + t["duplicated"] + t["different_tokens"] + t["stale"] for t in trials)
    bad += not final_ok
    during = sum(t["restarted"] > 0 for t in trials)
    goals = {
        "20 random worker kills during rollouts: exact samples, 0 duplicated, 0 stale, 0 lost": {
            "value": bad, "target": 0, "met": bad == 0 and repaired == len(delivered) == args.kills,
            "command": COMMAND, "kills_delivered": len(delivered), "workers_replaced": repaired,
            "trials_with_a_replacement_during_them": during,
        },
    }  # fmt: skip
    result = {"trials": trials, "reference_seconds": duration, "samples": len(reference)}
    update_result(OUT, "kills", result, goals)
    print(goals)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
