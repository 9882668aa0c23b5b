"""benchmarks/frontier.py's smoke run (tiny model, two short lengths): the table has every budget x measured
bin with P5, its interval and a speed-up against dense, and the best schedule is calibrate's rule."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import frontier  # noqa: E402


def test_quick_frontier_table(tmp_path):
    out = frontier.main(["--quick", "--out", str(tmp_path / "f.json")])
    table = out["frontier"]
    assert [r["budget"] for r in table["rows"]] == out["budgets"] == [24, 32, 48]
    for row in table["rows"]:
        measured = [c for c in row["cells"] if c["p5"] is not None]
        assert {c["length"] for c in measured} == {400, 700}
        assert all(c["p5_low"] <= c["p5_high"] and c["speedup_vs_dense"] > 0 for c in measured)
        assert all(c["speedup_shared_prompt"] > 0 for c in measured)
    assert set(out["cpu_step_s"]) == {"own_context", "shared_prompt"}
    assert [b["length"] for b in table["best_schedule"]] == [400, 700]
    assert set(out["goals"]) == {frontier.GOAL_TABLE, frontier.GOAL_BEST}
    assert out["goals"][frontier.GOAL_TABLE]["value"] == 700 and not out["goals"][frontier.GOAL_TABLE]["met"]


def test_a_bin_no_target_length_ends_in_shows_p5_alone():
    """Prompts land near, not at, their targets: a bin can hold tokens but no length (no speed measured)."""
    cell = {"p5": 0.9, "length": None, "speedup_vs_dense": None}
    table = {"rows": [{"budget": 64, "cells": [cell, cell | {"length": 400, "speedup_vs_dense": 1.5}]}]}
    assert frontier.table_lines(table) == ["    64  0.90  0.90/1.50x"]


def test_goals_skip_a_measured_bin_without_a_length():
    cell = {"p5": 0.9, "length": None, "speedup_vs_dense": None}
    table = {"rows": [{"budget": 64, "cells": [cell | {"length": 8192}, cell]}], "best_schedule": []}
    assert frontier.goals(table)[frontier.GOAL_TABLE]["value"] == 8192
