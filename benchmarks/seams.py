"""The seams issue's goals, measured on the code: behaviour kept (from benchmarks/behaviour_kept.py), the loop's
size and branches, import cycles, function lengths, and what a user-registered system takes.

    python benchmarks/seams.py --kept /tmp/kept/compare.json [later.json ...]   # docs/results/seams.json

`--kept` are the JSONs `behaviour_kept.py compare --json` wrote (its runs take about 0.3 CPU-hours); the other
goals read the source with `ast` and take seconds.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.test_import_graph import find_cycles, import_graph  # noqa: E402

LOOP = REPO / "sparserl" / "trainer" / "loop.py"
SETUP = {"__init__", "_setup", "_resume"}  # where a system may be chosen (built from the config)
SYSTEM_WORDS = re.compile(r"distill|sampling\.method|partial|april|dars|vcrl|spec", re.I)


def _functions(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _length(fn: ast.AST) -> int:
    return fn.end_lineno - fn.lineno + 1


def loop_goals() -> dict:
    """loop.py's lines, the system-specific names outside setup, and the step's length."""
    source = LOOP.read_text()
    fns = {f.name: f for f in _functions(LOOP)}
    branches = []
    for name, fn in fns.items():
        if name in SETUP:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.If | ast.IfExp):
                test = ast.get_source_segment(source, node.test) or ""
                if SYSTEM_WORDS.search(test):
                    branches.append(f"{name}: if {test}")
    step = _length(fns["rollout"]) + _length(fns["learn"])
    lines = len(source.splitlines())
    return {
        "trainer/loop.py under 380 lines": _goal(lines, 380, lines < 380, "lines"),
        "no distill or sampling-method branch outside setup": _goal(
            len(branches), 0, not branches, "branches", branches
        ),  # fmt: skip
        "the step (Trainer.rollout + Trainer.learn) under 90 lines": _goal(step, 90, step < 90, "lines"),
    }


def structure_goals() -> dict:
    """Import cycles (deferred imports included) and functions over 80 lines in algo, rollout, trainer."""
    cycles = find_cycles(import_graph())
    long = [
        f"{path.relative_to(REPO)}:{fn.name} ({_length(fn)})"
        for area in ("algo", "rollout", "trainer")
        for path in sorted((REPO / "sparserl" / area).glob("*.py"))
        for fn in _functions(path)
        if _length(fn) > 80
    ]
    return {
        "no import cycle, deferred ones included": _goal(
            len(cycles), 0, not cycles, "cycles", [" -> ".join(c) for c in cycles]
        ),  # fmt: skip
        "no function over 80 lines in sparserl/algo, rollout, trainer": _goal(
            len(long), 0, not long, "functions", long
        ),  # fmt: skip
    }


def registration_goal() -> dict:
    """Each README example: one class and one registration (tests/test_seams.py runs them)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    found = {}
    for kind in ("register_group_source", "register_adv_transform", "register_backend"):
        (block,) = [b for b in blocks if f"@{kind}" in b]
        tree = ast.parse(block)
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        found[kind] = {"classes": len(classes), "registrations": block.count(f"@{kind}(")}
    ok = all(v == {"classes": 1, "registrations": 1} for v in found.values())
    goal = _goal(1 if ok else 0, 1, ok, "true when each takes one class and one registration", found)
    return {
        "a user-registered group source, advantage transform and backend: one class, one registration": goal
    }


def _goal(value, target, met: bool, unit: str, detail=None) -> dict:
    out = {"value": value, "target": target, "met": bool(met), "unit": unit,
           "command": "python benchmarks/seams.py --kept KEPT_JSON"}  # fmt: skip
    if detail:
        out["detail"] = detail
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kept", type=Path, nargs="+", required=True,
                   help="behaviour_kept.py compare --json outputs (the seams commit, and later ones)")  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "seams.json")
    a = p.parse_args()
    kept = [json.loads(path.read_text()) for path in a.kept]
    met = all(k["met"] for k in kept)
    goals = {
        "behaviour kept: identical metrics.jsonl (timings aside) and torch.equal final weights": {
            "value": met,
            "target": True,
            "met": met,
            "unit": "true when both arms match at every pair of commits compared",
            "commits": [f"{k['base_commit']} -> {k['new_commit']}" for k in kept],
            "command": "python benchmarks/behaviour_kept.py record/compare (its docstring)",
        },
        **loop_goals(),
        **structure_goals(),
        **registration_goal(),
    }
    out = {"goals": goals, "behaviour_kept": kept}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(goals, indent=1))


if __name__ == "__main__":
    main()
