"""Rewards: answer extraction, equivalence (fast path and math-verify), format reward, fault guard."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparserl.tasks import Example, Task
from sparserl.tasks.answers import (
    extract_answer,
    extract_boxed,
    extract_hash_answer,
    format_reward,
    numeric_match,
    parse_number,
    reference_answer,
)
from sparserl.tasks.rewards import (
    MathVerifier,
    RewardStats,
    RewardTimeout,
    answers_match,
    get_verifier,
    math_reward,
    numeric_reward,
    safe_call,
)
from tests.shared_data import DATA

# A reference math-verify cannot finish: sympy evaluates the factorial of a million-digit number in C.
HANG = "(10^{10^{6}})!"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not close the box
        ("\\boxed{ 7 }", "7"),
        ("\\boxed 5 is it", "5"),
        ("$\\fbox{9}$", "9"),
        ("\\boxed{3} and a cut-off \\boxed{4", "3"),  # the last *well-formed* box
        ("no box here", None),
        ("\\boxed{", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_extract_hash_and_fallback_order() -> None:
    assert extract_hash_answer("work\n#### 1,450,000") == "1450000"
    assert extract_hash_answer("#### 18.\nmore text") == "18"
    assert extract_hash_answer("nothing") is None
    assert extract_answer("#### 5 but finally \\boxed{6}") == "6"
    assert extract_answer("it is\n#### -3") == "-3"
    assert extract_answer("it is 5") is None


@given(
    st.recursive(
        st.text(alphabet="ab1+ ", max_size=4), lambda s: s.map(lambda x: "{" + x + "}"), max_leaves=6
    )
)
def test_extract_boxed_roundtrips_balanced_content(content: str) -> None:
    assert extract_boxed(f"reasoning \\boxed{{{content}}} done") == content.strip()


def test_reference_answer_normalization() -> None:
    assert reference_answer(27.0) == "27"
    assert reference_answer(2.5) == "2.5"
    assert reference_answer(["$2$", "3"]) == "2, 3"
    assert reference_answer("$-1-\\sqrt{3}$") == "-1-\\sqrt{3}"
    assert reference_answer("so $x = \\boxed{\\frac{3}{4}}$.") == "\\frac{3}{4}"
    assert reference_answer("a\n#### 2,125") == "2125"
    with pytest.raises(ValueError):
        reference_answer(None)


def test_format_reward() -> None:
    assert format_reward("answer: \\boxed{4}") == 1.0
    assert format_reward("answer: \\boxed{}") == 0.0
    assert format_reward("answer: \\boxed{4") == 0.0
    assert format_reward("#### 4") == 0.0


# ------------------------------------------------------------------------------------------- numeric path


@pytest.mark.parametrize(
    ("text", "value"),
    [("42", 42), ("-3.50", -3.5), ("1,000", 1000), ("1{,}000", 1000), ("3/4", 0.75), ("$7$", 7), ("\\$5", 5)],
)
def test_parse_number(text: str, value: float) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["x", "1,2", "\\frac{1}{2}", "3+4", "", "1/0", "50\\%"])
def test_parse_number_rejects_non_numbers(text: str) -> None:
    assert parse_number(text) is None


def test_numeric_fast_path_decides_exact_cases_only() -> None:
    assert numeric_match("0.5", "1/2") is True
    assert numeric_match("27", "27.0") is True
    assert numeric_match("18", "19") is False
    assert numeric_match("0.333", "1/3") is None  # decimals may be rounded: defer to math-verify
    assert numeric_match("\\frac12", "0.5") is None


def test_fast_path_never_starts_the_worker() -> None:
    verifier = MathVerifier()
    assert answers_match("1,000", "1000", verifier=verifier)
    assert not answers_match("7", "8", verifier=verifier)
    assert verifier._proc is None


# ----------------------------------------------------------------------------------------------- math-verify


@pytest.mark.parametrize(
    ("gold", "pred", "expected"),
    [
        ("0.5", "\\frac{1}{2}", True),
        ("\\frac{1}{2}", "1/2", True),
        ("\\frac{14}{3}", "\\dfrac{14}{3}", True),
        ("18", "18 \\text{ dollars}", True),
        ("1.6", "1.6 \\mathrm{~cm}", True),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", True),
        ("x^2+1", "1+x^2", True),
        ("-1-\\sqrt{3}", "-1-\\sqrt3", True),
        ("\\frac{1}{2}", "\\frac{1}{3}", False),
        ("18", "18 \\text{ dollars and } 5", False),
        ("x^2+1", "x^2-1", False),
        ("(3, \\pi/2)", "(3, \\pi)", False),
        ("5", "", False),
    ],
)
def test_equivalence(gold: str, pred: str, expected: bool) -> None:
    assert answers_match(gold, pred) is expected


def test_math_reward_and_format_weight() -> None:
    assert math_reward("Thus \\boxed{\\frac{1}{2}}.", "0.5") == 1.0
    assert math_reward("Thus \\boxed{0.4}.", "0.5") == 0.0
    assert math_reward("Thus 0.5.", "0.5") == 0.0  # no extractable answer
    assert math_reward("Thus \\boxed{0.4}.", "0.5", format_weight=0.2) == pytest.approx(0.2)
    assert math_reward("Thus \\boxed{0.5}.", "0.5", format_weight=0.2) == pytest.approx(1.0)
    assert math_reward("#### 0.5", "0.5", format_weight=0.2) == pytest.approx(0.8)


def test_numeric_reward_rejects_unevaluated_expressions() -> None:
    assert numeric_reward("\\boxed{7}", "7") == 1.0
    assert numeric_reward("\\boxed{3+4}", "7") == 0.0
    assert numeric_reward("\\boxed{7.0}", "7") == 1.0
    assert numeric_reward("no answer", "7") == 0.0


def test_worker_timeout_kills_and_recovers() -> None:
    verifier = get_verifier()
    start = time.monotonic()
    with pytest.raises(RewardTimeout):
        answers_match("1", HANG, timeout=0.5)
    assert time.monotonic() - start < 3.0
    assert verifier._proc is None  # killed
    assert answers_match("\\frac{1}{2}", "0.5\\cdot 1", timeout=30)  # restarted


def test_worker_restarts_after_dying() -> None:
    verifier = MathVerifier()
    try:
        assert verifier.equivalent("\\boxed{2}", "\\boxed{4/2}")
        assert verifier._proc is not None
        verifier._proc.kill()
        verifier._proc.wait()
        assert not verifier.equivalent("\\boxed{2}", "\\boxed{3}")
    finally:
        verifier.close()
    assert verifier._proc is None


def test_worker_outlives_the_thread_that_started_it() -> None:
    """Linux signals PR_SET_PDEATHSIG when the *thread* that forked the worker ends; the worker must stay
    tied to the process: a custom task that first verifies from a short-lived thread keeps its worker."""
    verifier = MathVerifier()
    try:
        starter = threading.Thread(target=verifier.start)
        starter.start()
        starter.join(60)
        proc = verifier._proc
        assert proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # a worker killed with its thread is gone by now
        assert proc.poll() is None, "the worker died with the thread that started it"
        stats = RewardStats()
        assert (
            safe_call(answers_match, "\\frac{1}{2}", "0.5", 5.0, verifier, timeout=None, stats=stats) == 1.0
        )
        assert verifier._proc is proc and (stats.errors, stats.timeouts) == (0, 0)
    finally:
        verifier.close()


def test_worker_timeout_from_a_thread_counts_as_timeout() -> None:
    stats = RewardStats()
    out: list[float] = []

    def run() -> None:
        out.append(safe_call(math_reward, f"\\boxed{{{HANG}}}", "1", 0.0, 0.5, timeout=None, stats=stats))

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert out == [0.0]
    assert (stats.calls, stats.timeouts, stats.errors) == (1, 1, 0)


# ----------------------------------------------------------------------------------------------------- guard


def test_safe_call_raise_scores_zero_and_counts() -> None:
    stats = RewardStats()

    def boom(_: str) -> float:
        raise KeyError("nope")

    assert safe_call(boom, "x", timeout=None, stats=stats) == 0.0
    assert safe_call(lambda _: float("nan"), "x", timeout=None, stats=stats) == 0.0
    assert safe_call(lambda _: 0.75, "x", timeout=1.0, stats=stats) == 0.75
    assert (stats.calls, stats.errors, stats.timeouts) == (3, 2, 0)
    assert "nan" in stats.last_error
    assert stats.as_metrics() == {"reward/calls": 3.0, "reward/errors": 2.0, "reward/timeouts": 0.0}
    stats.reset()
    assert stats.as_metrics()["reward/errors"] == 0.0


class FaultyTask(Task):
    """A user task whose reward raises on 'raise' and hangs on 'hang'."""

    reward_timeout = 0.2

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> Example:
        return Example([{"role": "user", "content": "q"}], "1")

    def reward(self, completion_text: str, example: Example) -> float:
        if completion_text == "raise":
            raise RuntimeError("bad reward")
        if completion_text == "hang":
            time.sleep(30)
        return 1.0


def test_task_score_guards_raise_and_hang() -> None:
    task = FaultyTask()
    ex = task[0]
    start = time.monotonic()
    assert task.score_batch(["ok", "raise", "hang", "ok"], [ex] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - start < 2.0
    assert (task.stats.calls, task.stats.errors, task.stats.timeouts) == (4, 1, 1)


# ------------------------------------------------------------------------------------------------- real data


@pytest.mark.shared_data
def test_gsm8k_answers_extract_to_numbers() -> None:
    for split in ("train", "test"):
        rows = read_jsonl(DATA / "gsm8k" / f"{split}.jsonl")
        for row in rows:
            final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
            assert extract_hash_answer(row["answer"]) == final
            assert parse_number(final) is not None, final
        # The rationale itself, scored as a completion, earns the reward; a wrong number does not.
        for row in rows[:50]:
            gold = reference_answer(row["answer"])
            assert math_reward(row["answer"], gold) == 1.0
            assert math_reward(f"\\boxed{{{int(parse_number(gold)) + 1}}}", gold) == 0.0


@pytest.mark.shared_data
def test_math500_boxed_solution_matches_answer_field() -> None:
    rows = read_jsonl(DATA / "eval" / "math500.jsonl")
    for row in rows:
        boxed = extract_boxed(row["solution"])
        assert boxed is not None, row["unique_id"]
        assert answers_match(row["answer"], boxed, timeout=30), (row["answer"], boxed)


@pytest.mark.shared_data
def test_math_train_labels_and_minerva_solutions() -> None:
    rows = read_jsonl(DATA / "math" / "simplelr_level3to5_train.jsonl")
    labels = [reference_answer(r["label"]) for r in rows]
    assert sum(1 for a in labels if not a) == 2  # two unscorable rows in the file
    for row in read_jsonl(DATA / "eval" / "minerva_math.jsonl"):
        assert extract_boxed(row["solution"]), row["idx"]
    # Wrong answers score 0 on real references.
    for gold in [a for a in labels if a][:20]:
        assert math_reward("\\boxed{\\frac{9999}{7}}", gold) == 0.0
