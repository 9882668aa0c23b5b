"""The seams issues' goals, measured on the code: what a user's system takes (files per CONTRIBUTING.md example,
one class and one registration per README example), method names where no method should be named, sizes (the
loop, files, functions, README.md), import cycles, the trainer's imports of backends, and behaviour kept (from
benchmarks/behaviour_kept.py).

    python benchmarks/seams.py [--kept /tmp/kept/compare.json [later.json ...]]   # docs/results/seams.json

`--kept` are the JSONs `behaviour_kept.py compare --json` wrote (its runs take about 0.3 CPU-hours); without it
the comparisons already in the output file are kept. The other goals read the source and take seconds.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.test_contributing_examples import examples, files_touched  # noqa: E402
from tests.test_import_graph import find_cycles, import_graph, trainer_backend_imports  # noqa: E402

SPARSERL = REPO / "sparserl"
LOOP = SPARSERL / "trainer" / "loop.py"
COMMAND = "python benchmarks/seams.py"
SETUP = {"__init__", "_setup", "_resume"}  # where a system may be chosen (built from the config)
SYSTEM_WORDS = re.compile(r"distill|sampling\.method|partial|april|dars|vcrl|spec", re.I)
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_README_LINES = 450, 80, 300


def _goal(value: Any, target: Any, met: bool, unit: str, detail: Any = None) -> dict:
    out = {"value": value, "target": target, "met": bool(met), "unit": unit, "command": COMMAND}
    if detail:
        out["detail"] = detail
    return out


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _length(fn: ast.AST) -> int:
    return fn.end_lineno - fn.lineno + 1


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _sources() -> list[Path]:
    return sorted(SPARSERL.rglob("*.py"))


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
    lines = _lines(LOOP)
    return {
        "trainer/loop.py under 380 lines": _goal(lines, 380, lines < 380, "lines"),
        "no distill or sampling-method branch outside setup": _goal(
            len(branches), 0, not branches, "branches", branches
        ),  # fmt: skip
        "the step (Trainer.rollout + Trainer.learn) under 90 lines": _goal(step, 90, step < 90, "lines"),
    }


def size_goals() -> dict:
    """Files over 450 lines and functions over 80 lines in sparserl/, and README.md's lines."""
    rel = lambda p: str(p.relative_to(REPO))  # noqa: E731
    big = [f"{rel(p)} ({_lines(p)})" for p in _sources() if _lines(p) > MAX_FILE_LINES]
    long = [
        f"{rel(p)}:{fn.name} ({_length(fn)})"
        for p in _sources()
        for fn in _functions(p)
        if _length(fn) > MAX_FUNCTION_LINES
    ]
    readme = _lines(REPO / "README.md")
    return {
        "no file over 450 lines in sparserl/": _goal(len(big), 0, not big, "files", big),
        "no function over 80 lines in sparserl/": _goal(len(long), 0, not long, "functions", long),
        "README.md at most 300 lines": _goal(readme, MAX_README_LINES, readme <= MAX_README_LINES, "lines"),
    }


def import_goals() -> dict:
    """Import cycles (deferred imports included) and the trainer's imports of rollout backend modules."""
    cycles = find_cycles(import_graph())
    backends = trainer_backend_imports()
    return {
        "no import cycle, deferred ones included": _goal(
            len(cycles), 0, not cycles, "cycles", [" -> ".join(c) for c in cycles]
        ),  # fmt: skip
        "no module of sparserl.trainer imports sparserl.rollout.backend or ray_backend": _goal(
            len(backends), 0, not backends, "imports", backends
        ),  # fmt: skip
    }


def registered_names() -> dict[str, list[str]]:
    """Every registry of sparserl (each module imported, so that each registration ran): 'NAME (its config
    key)' -> its names."""
    import sparserl
    from sparserl.registry import Registry

    for module in pkgutil.walk_packages(sparserl.__path__, "sparserl."):
        if not module.name.endswith("__main__"):  # the CLI's entry point runs the CLI
            importlib.import_module(module.name)
    found = {
        id(value): (var, value)
        for name, mod in sorted(sys.modules.items())
        if name == "sparserl" or name.startswith("sparserl.")
        for var, value in vars(mod).items()
        if isinstance(value, Registry)
    }
    return {f"{var} ({r.key})": list(r) for var, r in found.values()}


def method_literals(paths: list[Path], names: set[str]) -> list[str]:
    """'file:line "name"' for each string literal of `paths` equal to one of `names`, in file order."""
    return [
        f"{path.relative_to(REPO)}:{line} {value!r}"
        for path in paths
        for line, _, value in sorted(
            (node.lineno, node.col_offset, node.value)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
        )
    ]


def method_name_goal() -> dict:
    """String literals naming a registered method in config/checks.py and trainer/: a system chosen by its
    name there, where the registry should say what it is. The count is checked on the modules that register
    names (it must find them there), so that a counter that sees nothing cannot pass."""
    registries = registered_names()
    names = {n for ns in registries.values() for n in ns}
    paths = [SPARSERL / "config" / "checks.py", *sorted((SPARSERL / "trainer").rglob("*.py"))]
    hits = method_literals(paths, names)
    sanity = method_literals([SPARSERL / "rollout" / "sources.py", SPARSERL / "algo" / "losses.py"], names)
    if not sanity:
        raise RuntimeError(
            "the method-name counter found no name where the sources and losses register theirs"
        )
    detail = {
        "literals": hits,
        "registries": registries,
        "found where registered (counter check)": len(sanity),
    }
    return {
        "no registered method name as a string literal in config/checks.py and trainer/": _goal(
            len(hits), 0, not hits, "string literals", detail
        )
    }


def example_goals() -> dict:
    """Files a user touches per CONTRIBUTING.md example (tests/test_contributing_examples.py runs each), and
    one class and one registration per README.md example (tests/test_seams.py runs them)."""
    touched = {e.name: files_touched(e) for e in examples()}
    most = max(touched.values(), default=0)
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    found = {}
    for kind in ("register_group_source", "register_adv_transform", "register_backend"):
        (block,) = [b for b in blocks if f"@{kind}" in b]
        classes = [n for n in ast.parse(block).body if isinstance(n, ast.ClassDef)]
        found[kind] = {"classes": len(classes), "registrations": block.count(f"@{kind}(")}
    ok = all(v == {"classes": 1, "registrations": 1} for v in found.values())
    return {
        "files a user touches per CONTRIBUTING.md example (the most over the examples)": _goal(
            most, 1, bool(touched) and most == 1, "files", touched
        ),
        "a user-registered group source, advantage transform and backend: one class, one registration": _goal(
            1 if ok else 0, 1, ok, "true when each takes one class and one registration", found
        ),
    }


def kept_goal(kept: list[dict]) -> dict:
    """Behaviour kept at every pair of commits `behaviour_kept.py compare` compared."""
    met = bool(kept) and all(k["met"] for k in kept)
    return {
        "behaviour kept: identical metrics.jsonl (timings aside) and torch.equal final weights": {
            "value": met,
            "target": True,
            "met": met,
            "unit": "true when both arms match at every pair of commits compared",
            "commits": [f"{k['base_commit']} -> {k['new_commit']}" for k in kept],
            "command": "python benchmarks/behaviour_kept.py record/compare (its docstring)",
            "notes": {f"{k['base_commit']} -> {k['new_commit']}": k["note"] for k in kept if "note" in k},
        }
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kept", type=Path, nargs="+", default=[],
                   help="behaviour_kept.py compare --json outputs (default: those already in --out)")  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "seams.json")
    a = p.parse_args()
    previous = json.loads(a.out.read_text()) if a.out.is_file() else {}
    kept = [json.loads(path.read_text()) for path in a.kept] or previous.get("behaviour_kept", [])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    goals = {
        **example_goals(),
        **method_name_goal(),
        **loop_goals(),
        **size_goals(),
        **import_goals(),
        **kept_goal(kept),
    }
    out = {"measured_at": head.stdout.strip(), "goals": goals, "behaviour_kept": kept}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: {"value": v["value"], "met": v["met"]} for k, v in goals.items()}, indent=1))


if __name__ == "__main__":
    main()
