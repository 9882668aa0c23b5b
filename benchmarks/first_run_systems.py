"""Every system of the README's "one key each" list, run as the README writes it (plus 2 steps, no eval, one
thread, a folder of its own) on the embedded default (SmolLM2-135M): the count of commands that fail, and of those
whose console does not name their system.

    python benchmarks/first_run_systems.py           # ~2-3 CPU-minutes per command, one at a time

Writes the goal and each command's result into docs/results/first_run.json (section `systems`), keeping the
other goals of that file.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import record_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GOAL_NAME = "Every system of the README's 'one key each' list runs 2 steps on SmolLM2 as written, named on the console"
COMMAND = "python benchmarks/first_run_systems.py"
EXTRA = ["trainer.steps=2", "trainer.eval_prompts=0", "trainer.threads=1", "logging.tensorboard=false"]
# what the console must say for each system (the header's 'systems on:' line, or its algo/loss)
NAMED = {"sampling.method=dars": "sampling dars", "sampling.method=vcrl": "sampling vcrl",
         "sampling.dynamic=true": "dynamic sampling", "shaping.method=uniqueness": "shaping uniqueness",
         "algo.preset=gspo": "loss gspo", "rollout.spec.enable=true": "SPEC-RL reuse",
         "rollout.tree.enable=true": "tree rollouts"}  # fmt: skip


def readme_commands() -> list[list[str]]:
    """The `sparserl train ...` lines of the README's block after 'one key each', comments dropped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"one key each.*?```\n(.*?)```", text, re.S)
    if block is None:
        raise SystemExit("README.md: no 'one key each' code block found")
    lines = [line.split("#")[0].strip() for line in block.group(1).splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("sparserl train")]


def run_one(keys: list[str], folder: Path) -> dict:
    """One command: exit code, CPU seconds, whether the console named its system, the error's last line."""
    cmd = [sys.executable, "-m", "sparserl.cli", "train", *keys, *EXTRA, f"trainer.output_dir={folder}"]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={"OMP_NUM_THREADS": "1",
                          **__import__("os").environ})  # fmt: skip
    said = done.stdout + done.stderr
    wanted = [name for key, name in NAMED.items() if key in keys]
    return {"keys": keys, "returncode": done.returncode, "wall_s": round(time.time() - t0, 1),
            "named": all(w in said for w in wanted), "expected_names": wanted,
            "error": done.stderr.strip().splitlines()[-1] if done.returncode else None}  # fmt: skip


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, keys in enumerate(readme_commands()):
            rows.append(run_one(keys, Path(tmp) / str(i)))
            print(rows[-1], flush=True)
    failures = sum(r["returncode"] != 0 or not r["named"] for r in rows)
    goal = {GOAL_NAME: {"value": failures, "target": 0, "met": failures == 0 and bool(rows), "command": COMMAND,
                        "unit": "commands that failed or whose console did not name their system"}}  # fmt: skip
    path = record_result("first_run.json", "systems", {"commands": rows, "extra_overrides": EXTRA}, goal)
    print(f"{failures} of {len(rows)} failed -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
