"""Study v2's recall check: how a completion restates the queried values, and the per-class table."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
recall = importlib.import_module(
    "study_v2_recall"
)  # a broken import fails the tests rather than skipping them

FACTS = {"alpha": 9, "uniform": 0}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("alpha = 9 and uniform = 0, so uniform + alpha = 0 + 9 = 9. \\boxed{9}", "recalled"),
        ("Let alpha=9. uniform =0 so", "recalled"),
        ("alphabet = 4, alpha = 9, uniform = 0", "recalled"),  # another name that starts alike is not alpha
        ("alpha = 3 and uniform = 0, so 3", "misrecalled"),
        ("alpha = 9, so the answer is 9", "unstated"),  # uniform never restated
        ("uniform + alpha = 0 + 9 = 9", "unstated"),  # inside an expression: not a restatement
        ("alpha = 9 and uniform = -2", "misrecalled"),
    ],
)
def test_recall_class(text, expected):
    assert recall.recall_class(text, FACTS) == expected


def test_recall_table_shares_and_accuracy_per_class():
    table = recall.recall_table(
        [("recalled", 1.0), ("recalled", 0.0), ("misrecalled", 0.0), ("unstated", 1.0)]
    )
    assert table["samples"] == 4 and table["accuracy"] == 0.5
    assert table["recalled"] == {"share": 0.5, "accuracy": 0.5}
    assert table["misrecalled"] == {"share": 0.25, "accuracy": 0.0}
    assert recall.recall_table([("recalled", 1.0)])["unstated"] == {"share": 0.0, "accuracy": None}
