"""What TRL and verl users expect, counted into docs/results/ecosystem.json (keeping its other goals):

    python benchmarks/ecosystem.py

- the reward-function examples of TRL's GRPO documentation (rewritten in tests/test_reward_styles.py) that fail
  to run unchanged (their test run here);
- the W&B (offline) and MLflow (file store) tests CI runs: CI installs `.[dev,ray]`, so a tracker whose package
  only the `tracking` extra brings is skipped there, and counted as not passing in CI;
- float16's sampler/learner log-prob gap, copied from docs/results/precision.json (benchmarks/precision.py).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, update_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python benchmarks/ecosystem.py"
EXAMPLES_TESTS = (  # every example function of the rewritten documentation module is called by one of these
    "tests/test_reward_styles.py::test_trl_documentation_examples_run_unchanged",
    "tests/test_reward_styles.py::test_conversational_data_gets_message_completions",
)


def trl_examples() -> list[str]:
    """The functions of the test's rewritten TRL documentation module (its TRL_DOCS_PY string)."""
    tree = ast.parse((ROOT / "tests" / "test_reward_styles.py").read_text())
    source = next(
        n.value.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "TRL_DOCS_PY"
    )
    return [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def tests_pass(*ids: str) -> bool:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    return done.returncode == 0


def ci_skipped_trackers() -> list[str]:
    """Trackers whose test needs a package the dev extra (what CI installs) does not bring."""
    line = re.search(r"^dev = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M)
    dev = {re.split(r"[<>=\[ ]", d.strip().strip('"'))[0] for d in line.group(1).split(",")}
    modules = {name.removesuffix("-skinny") for name in dev}  # mlflow-skinny installs the `mlflow` module
    return [t for t in ("wandb", "mlflow") if t not in modules]


def main() -> None:
    examples = trl_examples()
    failing = 0 if tests_pass(*EXAMPLES_TESTS) else len(examples)
    trackers_ok = tests_pass("tests/test_trackers.py", "-k", "wandb or mlflow")
    skipped = ci_skipped_trackers()
    precision = json.loads((RESULTS / "precision.json").read_text())["goals"]
    goals = {
        "The reward-function examples of TRL's GRPO documentation run unchanged": {
            "value": failing, "target": 0, "met": failing == 0, "command": COMMAND,
            "unit": f"examples failing, of {len(examples)}: {', '.join(examples)}"},
        "W&B offline and MLflow tests pass in CI": {
            "value": len(skipped) + (0 if trackers_ok else 2), "target": 0, "met": trackers_ok and not skipped,
            "command": COMMAND, "unit": "tracker tests failing here or skipped in CI",
            "skipped_in_ci": {t: "its package is only in the `tracking` extra" for t in skipped}},
        **precision,
    }  # fmt: skip
    update_result(
        RESULTS / "ecosystem.json", "counts", {"trl_examples": examples, "ci_skipped": skipped}, goals
    )
    for name, g in goals.items():
        print(f"{name}: {g['value']} (met: {g['met']})")


if __name__ == "__main__":
    main()
