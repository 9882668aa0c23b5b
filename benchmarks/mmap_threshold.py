"""What glibc's mmap threshold (`trainer.malloc_mmap_threshold`) costs and saves: each arm in a process of its own
(arms alternating, `--repeats` rounds), at one thread: one default step's rollout and scoring (its update skipped),
then the learner's update twice on that batch from the same weights, optimizer and schedule. Records CPU seconds,
minor page faults (every page of a fresh mapping faults once) and the process's peak RSS; the loss must come out the
same in every arm (where memory comes from changes no number).

    python benchmarks/mmap_threshold.py                                    # 128 KiB .. glibc's own, 2 rounds
    python benchmarks/mmap_threshold.py --arms 131072,0 --repeats 3

Writes docs/results/memory.json section `mmap_threshold`. The whole run's peak is `benchmarks/memory.py
trainer.malloc_mmap_threshold=N`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, OneBatchUpdates, machine_info, update_result  # noqa: E402

MARK = "ARM "


def one_arm(threshold: int) -> dict:
    """This process's measurements under `threshold` (set by the policy's load, as in a run)."""
    import resource

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    out: dict = {"threshold": threshold, "update_cpu_s": [], "update_minor_faults": []}
    with OneBatchUpdates([f"trainer.malloc_mmap_threshold={threshold}"]) as runs:
        out["rollout_and_score_cpu_s"] = runs.rollout_and_score_cpu_s
        for _ in range(2):
            f0, c0 = faults(), time.process_time()
            metrics = runs.update()
            out["update_cpu_s"].append(time.process_time() - c0)
            out["update_minor_faults"].append(faults() - f0)
        out["pg_loss"] = metrics.get("actor/pg_loss")
        out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="131072,262144,1048576,0", help="thresholds in bytes (0: glibc's own)")
    p.add_argument("--repeats", type=int, default=2, help="rounds of every arm, alternating")
    p.add_argument("--arm", type=int, help=argparse.SUPPRESS)  # one arm, in this process
    args = p.parse_args()
    if args.arm is not None:
        print(MARK + json.dumps(one_arm(args.arm)), flush=True)
        return
    arms = [int(a) for a in args.arms.split(",")]
    runs: dict[str, list[dict]] = {str(a): [] for a in arms}
    for _ in range(args.repeats):
        for a in arms:
            done = subprocess.run([sys.executable, __file__, "--arm", str(a)], capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith(MARK)]
            if done.returncode or not lines:
                raise SystemExit(f"arm {a} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            runs[str(a)].append(json.loads(lines[-1][len(MARK) :]))
            print(a, runs[str(a)][-1], flush=True)

    def median(arm: str, key: str, second_update: bool = False) -> float:
        """The arm's median of `key`; of the second update's value (the process's allocations settled)."""
        return statistics.median(r[key][-1] if second_update else r[key] for r in runs[arm])

    medians = {
        a: {
            "update_cpu_s": median(a, "update_cpu_s", second_update=True),
            "update_minor_faults": median(a, "update_minor_faults", second_update=True),
            "rollout_and_score_cpu_s": median(a, "rollout_and_score_cpu_s"),
            "peak_rss_mib": median(a, "peak_rss_mib"),
        }
        for a in runs
    }
    base = str(arms[0])
    payload = {
        "what": __doc__.split("\n\n")[0],
        "runs": runs,
        "medians": medians,
        "update_cpu_over_first_arm": {
            a: m["update_cpu_s"] / medians[base]["update_cpu_s"] for a, m in medians.items()
        },
        "same_loss": len({r["pg_loss"] for rs in runs.values() for r in rs}) == 1,
        "machine": machine_info(),
        "command": f"python benchmarks/mmap_threshold.py --arms {args.arms} --repeats {args.repeats}",
    }
    update_result(RESULTS / "memory.json", "mmap_threshold", payload, {})
    for a, m in medians.items():
        print(f"{a:>9}: update {m['update_cpu_s']:.1f} CPU s, {m['update_minor_faults']:.0f} faults; rollout+score "
              f"{m['rollout_and_score_cpu_s']:.1f} s; peak {m['peak_rss_mib']:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
