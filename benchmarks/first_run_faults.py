"""The fault probe's defect rows (processes left by reward code, Ray errors, settings of a feature that is off,
reward_timeout=inf, resampling with rollout.n=1), each a test row of the project's bad-input and fault tests:
how many fail now; and how many processes started by reward code are alive after `sparserl train` exits (a reward
module that forks at import and a function that starts a subprocess per call, on the tiny model).

    python benchmarks/first_run_faults.py      # ~2 CPU-minutes

Writes both goals into docs/results/first_run.json (section `faults`), keeping the other goals of that file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import record_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
COMMAND = "python benchmarks/first_run_faults.py"
ISOLATION = "tests/test_reward_isolation.py::"
BAD_INPUT = "tests/test_bad_input.py::test_bad_input_is_one_clear_line"
# the probe's defect rows, by item: 13 reward processes, 14 Ray errors, 15 keys of a feature that is off, 16 inf
# timeouts, 17 resampling with one sample per group
ROWS = {
    13: [f"{ISOLATION}test_processes_started_by_reward_code_end_with_its_worker[{k}]"
         for k in ("forks-per-call", "forks-at-import", "daemonizes", "overruns-its-timeout")],
    14: [f"{BAD_INPUT}[{k}]" for k in ("train-ray-address-garbage", "train-ray-address-unreachable",
                                      "train-rollout-workers-unschedulable", "train-learners-unschedulable",
                                      "train-swarm-pool-empty")],
    15: [f"{BAD_INPUT}[{k}]" for k in ("train-dars-key-without-dars", "train-vcrl-key-without-vcrl",
                                      "train-spec-key-when-off", "train-tree-key-when-off",
                                      "train-tree-advantages-without-tree", "train-judge-without-shaping",
                                      "train-overlong-penalty-without-buffer", "train-weight-sync-without-workers",
                                      "train-partial-key-when-off")],
    16: [f"{ISOLATION}test_a_reward_timeout_of_inf_means_no_limit[{k}]" for k in ("inf", "1e12")],
    17: [f"{BAD_INPUT}[{k}]" for k in ("train-dynamic-sampling-n1", "train-vcrl-n1")],
}  # fmt: skip


def failing_rows(tmp: Path) -> dict[str, str]:
    """Each row's outcome (passed, failed, error, skipped, missing) from one pytest run over all of them."""
    nodes = [n for rows in ROWS.values() for n in rows]
    xml = tmp / "rows.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *nodes],
                   cwd=ROOT, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    outcome = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    return {n: outcome.get(n, "missing") for n in nodes}


def leftover_processes(tmp: Path) -> int:
    """Processes a forking reward module started during a one-step tiny run that are alive after it exits."""
    from tests.test_reward_isolation import alive, spawning_run

    pids = spawning_run(tmp)
    time.sleep(5)  # what a kill sent at exit needs to land
    return sum(alive(p) for p in pids)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rows = failing_rows(Path(tmp))
        left = leftover_processes(Path(tmp))
    failing = [n for n, o in rows.items() if o != "passed"]
    goals = {
        "The fault probe's defect rows (items 13-17) each pass as a test row": {
            "value": len(failing), "target": 0, "met": not failing, "command": COMMAND,
            "unit": f"rows failing, errored, skipped or missing, of {len(rows)}"},
        "Processes left behind by reward code after a run": {
            "value": left, "target": 0, "met": left == 0, "command": COMMAND},
    }  # fmt: skip
    path = record_result("first_run.json", "faults", {"rows": rows, "leftover_processes": left}, goals)
    print(f"{len(failing)} of {len(rows)} rows not passing {failing}; {left} processes left -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
