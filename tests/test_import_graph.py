"""sparserl's modules import each other without a cycle, deferred imports (inside functions) included.

Every module under sparserl/ is parsed with `ast` (never imported) and each `import` / `from ... import`
anywhere in it, at the top level or inside a function or class, becomes an edge A -> B:
- `import a.b.c` -> the module a.b.c;
- `from a.b import c` -> a.b.c when that is a module (or package), else a.b (a package's __init__);
- relative imports resolve against A's package (`from . import x` in a package's __init__ means its own
  package);
- imports of anything outside sparserl are ignored, and so are those under `if TYPE_CHECKING:` (they never
  run: annotations only).

Importing a submodule also runs its parent packages' __init__ first; that implicit import is not an edge,
because the parent is always loaded before the child and a package's __init__ may import (re-export) its
own submodules. But a submodule that imports names from its own package (`from sparserl.cli import x` in
sparserl/cli/train.py) gets the explicit edge to that __init__, so it is a cycle as soon as the __init__
imports that submodule, which is exactly the case where the name may not exist yet (a half-initialised
package).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "sparserl"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in `tree`, at any depth, except those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """module -> {imported module of the package `root`: 'file:line' of the first import statement naming it}."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: dict[str, str] = {}
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    base_parts = package[: len(package) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
            own_packages = _ancestors(name) | ({name} if is_package else set())
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name inside a.b
                    target = target.rpartition(".")[0]
                if target.split(".")[0] != root.name:
                    continue
                # the target, then the packages Python initialises before it (those not already loading)
                for module in [target, *sorted(_ancestors(target) - own_packages)]:
                    if module != name:
                        edges.setdefault(module, where)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle (a closed path of modules) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is small enough to recurse
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)

    cycles = []
    for component in components:
        start = min(component)
        # breadth-first from start back to start inside the component: the shortest cycle through it
        parents: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parents:
            nxt_frontier = []
            for node in frontier:
                for nxt in sorted(graph[node]):
                    if nxt in component and nxt not in parents:
                        parents[nxt] = node
                        nxt_frontier.append(nxt)
            frontier = nxt_frontier
        path = [start]
        node = parents[start]
        while node != start:
            path.append(node)
            node = parents[node]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def _describe(cycle: list[str], graph: dict[str, dict[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False))


def test_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.sub import leaf\n",
        "sub/__init__.py": "NAME = 1\n",
        "sub/leaf.py": "import os\n",
        "top.py": (
            "from typing import TYPE_CHECKING\n"
            "from . import other\n"  # a sibling module, relative
            "from .sub import NAME\n"  # a name: the package's __init__
            "if TYPE_CHECKING:\n    from pkg import late\n"  # never runs: no edge
            "def f():\n    import pkg.sub.leaf\n"  # deferred, and pkg.sub's __init__ runs first
        ),
        "other.py": "",
        "late.py": "",
        "sub/inner.py": "from .. import top\nfrom . import NAME\n",  # its own package's names: an edge
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert set(graph["pkg.top"]) == {"pkg.other", "pkg.sub", "pkg.sub.leaf"}
    assert graph["pkg.top"]["pkg.sub.leaf"] == "pkg/top.py:7"
    assert set(graph["pkg.sub.inner"]) == {"pkg.top", "pkg.sub"}
    assert set(graph["pkg"]) == {"pkg.sub", "pkg.sub.leaf"}
    assert graph["pkg.sub.leaf"] == {}  # os is not the package's
    # the sub-package's __init__ imports nothing, so inner -> sub is no cycle; inner -> top -> sub is none either
    assert find_cycles(graph) == []
    (pkg / "sub/__init__.py").write_text("from pkg.sub import inner\n")
    assert find_cycles(import_graph(pkg)) == [["pkg.sub", "pkg.sub.inner", "pkg.sub"]]


def test_finder_reports_a_cycle():
    graph = {
        "a": {"b": "a.py:1"},
        "b": {"c": "b.py:3"},
        "c": {"a": "c.py:9"},
        "d": {"a": "d.py:1"},
    }
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": ""}, "b": {}}) == []


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    message = "\n\n".join(f"import cycle:\n{_describe(cycle, graph)}" for cycle in cycles)
    assert not cycles, message


BACKEND_MODULES = ("sparserl.rollout.backend", "sparserl.rollout.ray_backend")


def _names_taken_from(init: Path, modules: tuple[str, ...]) -> set[str]:
    """The names a package's __init__ imports from `modules` (what it re-exports from them)."""
    tree = ast.parse(init.read_text(), filename=str(init))
    return {
        alias.asname or alias.name
        for node in _imports(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules
        for alias in node.names
    }


def trainer_backend_imports() -> list[str]:
    """'module -> backend (where)' for each module of sparserl.trainer that imports a rollout backend module,
    deferred imports included, or a name the rollout package re-exports from one."""
    graph = import_graph()
    files = {_module_name(p, ROOT): p for p in ROOT.rglob("*.py")}
    trainer = {m: p for m, p in files.items() if m == "sparserl.trainer" or m.startswith("sparserl.trainer.")}
    found = [f"{m} -> {b} ({graph[m][b]})" for m in trainer for b in BACKEND_MODULES if b in graph[m]]
    reexported = _names_taken_from(ROOT / "rollout" / "__init__.py", BACKEND_MODULES)
    assert {"make_backend", "check_backend", "LocalBackend"} <= reexported  # what the check below looks for
    for module, path in trainer.items():
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "sparserl.rollout":
                names = sorted({a.name for a in node.names} & reexported)
                found += [f"{module} -> sparserl.rollout.{name} (line {node.lineno})" for name in names]
    return found


def test_the_trainer_imports_no_rollout_backend():
    """The trainer builds its backend through the rollout layer's entry point (sparserl.rollout.build) and
    never names one."""
    found = trainer_backend_imports()
    assert not found, "the trainer imports a rollout backend:\n  " + "\n  ".join(found)
