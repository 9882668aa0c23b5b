"""What a fresh clone of the project has: its docs and every command's help cite only files inside it, and the
tests that read the shared data folder (beside a checkout, never in a clone) carry the `shared_data` marker, so
that a clone says why they skip and the CI runs them where the folder exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sparserl.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared|shared/(data|specs)")


def command_helps() -> dict[str, str]:
    """Each subcommand's --help text (and the top-level one)."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.choices and isinstance(a.choices, dict)]
    return {"sparserl": parser.format_help(), **{n: p.format_help() for n, p in sub.choices.items()}}


def test_docs_help_configs_and_library_cite_no_file_outside_the_project() -> None:
    """A clone has no folder beside it: the docs, the help, the shipped configs and the library name none."""
    shipped = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "configs").glob("*.yaml")]
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in [*shipped, *(ROOT / "sparserl").rglob("*.py")]}
    texts |= {f"{name} --help": text for name, text in command_helps().items()}
    cited = {where: OUTSIDE.findall(text) for where, text in texts.items() if OUTSIDE.search(text)}
    assert not cited, cited


def test_tests_reading_the_shared_data_are_marked() -> None:
    """Every test function that reads DATA (tests/shared_data.py) is marked shared_data, a registered marker."""
    assert "shared_data:" in (ROOT / "pyproject.toml").read_text()
    unmarked = []
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            reads = any(isinstance(n, ast.Name) and n.id == "DATA" for n in ast.walk(node))
            marks = [ast.unparse(d) for d in node.decorator_list]
            if reads and "pytest.mark.shared_data" not in marks:
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, unmarked


def test_a_missing_shared_data_folder_is_named_in_the_skip(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests import conftest

    missing = tmp_path / "shared" / "data"
    monkeypatch.setattr(conftest, "DATA", missing)
    request.node.add_marker(pytest.mark.shared_data)
    with pytest.raises(pytest.skip.Exception, match=re.escape(str(missing)) + ".*absent in a clone"):
        conftest.pytest_runtest_setup(request.node)
