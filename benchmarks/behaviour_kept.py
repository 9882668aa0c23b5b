"""Behaviour kept across a refactor: the same `sparserl train` run on two checkouts gives the same metrics
(timings aside) and `torch.equal` final weights.

    python benchmarks/behaviour_kept.py record --code /path/to/old/checkout --out /tmp/kept/old
    python benchmarks/behaviour_kept.py record --code . --out /tmp/kept/new
    python benchmarks/behaviour_kept.py compare /tmp/kept/old /tmp/kept/new --base-commit A --new-commit B

Each arm runs in its own process at one thread (`trainer.threads=1`), with the code of `--code` first on the
import path. CPU cost: two 3-step runs of the default config per checkout, about 0.15 CPU-hours each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sparserl.signals import stoppable

REPO = Path(__file__).resolve().parent.parent
ARMS = {
    "default": ["trainer.steps=3"],
    "kv_cap_partial": ["trainer.steps=3", "rollout.kv_memory_cap=64MiB", "rollout.partial.enable=true"],
}
RUN = "import sys; from sparserl.cli import main; sys.argv[0] = 'sparserl'; sys.exit(main())"


def record(code: Path, out: Path) -> None:
    """Train every arm with the code at `code`; keep its metrics.jsonl and final checkpoint weights."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(code.resolve())}
    for arm, overrides in ARMS.items():
        if (out / arm / "done").is_file():
            continue  # resumable: a finished arm is not run again
        runs = out / arm / "runs"
        args = [*overrides, "trainer.threads=1", f"trainer.output_dir={runs}", "trainer.run_name=kept"]
        args += ["logging.progress=false", "logging.tensorboard=false"]
        cpu0, t0 = _children_cpu(), time.time()
        subprocess.run([sys.executable, "-c", RUN, "train", *args], env=env, check=True, cwd=code)
        info = {"wall_s": time.time() - t0, "cpu_s": _children_cpu() - cpu0, "overrides": args}
        (out / arm / "done").write_text(json.dumps(info))


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _metrics(path: Path) -> list[dict]:
    """metrics.jsonl without the timing keys (time/*, *_s and throughput figures differ run to run)."""
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not _is_timing(k)})
    return rows


def _is_timing(key: str) -> bool:
    return (
        key == "time"
        or key.startswith("time/")
        or key.endswith("_s")
        or "per_s" in key
        or "tokens_per" in key
    )


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    return {p.name: load_file(p) for p in ckpt.glob("*.safetensors")}


def compare(base: Path, new: Path, base_commit: str, new_commit: str) -> dict:
    """Per arm: metrics equal (timings aside) and weights torch.equal; the goal into docs/results/seams.json."""
    import torch

    arms = {}
    for arm in ARMS:
        a, b = base / arm / "runs" / "kept", new / arm / "runs" / "kept"
        ma, mb = _metrics(a / "metrics.jsonl"), _metrics(b / "metrics.jsonl")
        differing = sorted({k for ra, rb in zip(ma, mb, strict=False) for k in ra.keys() | rb.keys()
                            if ra.get(k) != rb.get(k)})  # fmt: skip
        wa, wb = _weights(a), _weights(b)
        equal = wa.keys() == wb.keys() and all(
            wa[f].keys() == wb[f].keys() and all(torch.equal(wa[f][k], wb[f][k]) for k in wa[f]) for f in wa
        )
        arms[arm] = {
            "metrics_rows": [len(ma), len(mb)],
            "metrics_equal": len(ma) == len(mb) and not differing,
            "differing_metrics": differing,
            "weights_equal": equal,
        }
    kept = all(r["metrics_equal"] and r["weights_equal"] for r in arms.values())
    return {
        "goal": "Behaviour kept: identical metrics.jsonl (timings aside) and torch.equal final weights",
        "value": kept,
        "target": True,
        "met": kept,
        "base_commit": base_commit,
        "new_commit": new_commit,
        "arms": arms,
        "command": "python benchmarks/behaviour_kept.py record/compare (see the module docstring)",
    }


@stoppable("benchmarks/behaviour_kept.py", "this arm's run is incomplete; record it again", exits=True)
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--code", type=Path, default=REPO)
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("base", type=Path)
    c.add_argument("new", type=Path)
    c.add_argument("--base-commit", required=True)
    c.add_argument("--new-commit", required=True)
    c.add_argument("--json", type=Path, default=None, help="print only when omitted")
    a = p.parse_args()
    if a.cmd == "record":
        record(a.code, a.out)
    else:
        result = compare(a.base, a.new, a.base_commit, a.new_commit)
        print(json.dumps(result, indent=1))
        if a.json is not None:
            a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
