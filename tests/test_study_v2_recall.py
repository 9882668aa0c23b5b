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

FACTS = {"alpha": 9, "uniform": 2}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("alpha = 9 and uniform = 2, so uniform + alpha = 2 + 9 = 11. \\boxed{11}", "recalled"),
        ("Let alpha=9. uniform =2 so", "recalled"),
        ("Alpha = 9 and Uniform = 2", "recalled"),  # any case
        ("- alpha = 9\n- uniform = 2", "recalled"),  # bullets on their own lines
        ("* alpha = 3\n* uniform = 2", "misrecalled"),
        ("alphabet = 4, alpha = 9, uniform = 2", "recalled"),  # a longer name that starts alike is not alpha
        ("xalpha = 4, alpha = 9, uniform = 2", "recalled"),  # nor one that ends alike
        ("alpha = 3 and uniform = 2, so 5", "misrecalled"),
        ("alpha = 9 and uniform = -2", "misrecalled"),  # the sign is read
        ("alpha = 9, so the answer is 9", "unstated"),  # uniform never restated
        ("uniform + alpha = 5, and uniform = 2", "unstated"),  # an operator before the name: inside a sum
        ("alpha = 3 + 6, uniform = 2", "unstated"),  # an operator after the number: inside a sum
    ],
)
def test_recall_class(text, expected):
    assert recall.recall_class(text, FACTS) == expected


def test_recall_table_shares_accuracy_and_examples_per_class():
    rows = [("recalled", 1.0, "a"), ("recalled", 0.0, "b"), ("misrecalled", 0.0, "c"), ("unstated", 1.0, "d")]
    table = recall.recall_table(rows)
    assert table["samples"] == 4 and table["accuracy"] == 0.5
    assert table["recalled"] == {"share": 0.5, "accuracy": 0.5, "examples": ["a", "b"]}
    assert table["misrecalled"] == {"share": 0.25, "accuracy": 0.0, "examples": ["c"]}
    assert recall.recall_table(rows[:1])["unstated"] == {"share": 0.0, "accuracy": None, "examples": []}


def test_step_prompts_view_reads_the_drawn_rows_in_order_and_scores_with_the_task():
    from sparserl.tasks import Example, Task

    class Numbers(Task):
        name = "numbers"

        def __len__(self):
            return 5

        def __getitem__(self, i):
            return Example(messages=[{"role": "user", "content": str(i)}], answer=str(i))

        def reward(self, completion_text, example):
            return float(completion_text == example.answer)

    view = recall.StepPrompts(Numbers(), [3, 0, 3])
    assert len(view) == 3 and view.name == "numbers"
    assert [ex.answer for ex in view] == ["3", "0", "3"]
    assert view.score("3", view[0]) == 1.0 and view.score("3", view[1]) == 0.0
