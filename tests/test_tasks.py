"""Tasks: config checks, procedural generators, dataset loading with field mapping and row errors."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

from sparserl.errors import DataError, UserError
from sparserl.registry import Registry
from sparserl.tasks import (
    BOXED_INSTRUCTION,
    BUILTIN_TASKS,
    TASKS,
    Example,
    TaskConfig,
    make_task,
    register_task,
)
from sparserl.tasks.answers import reference_answer
from sparserl.tasks.arithmetic import ArithmeticTask, evaluate
from sparserl.tasks.dataset import DatasetTask
from sparserl.tasks.long_arithmetic import FACT_NAMES
from tests.shared_data import DATA


def user_text(ex: Example) -> str:
    assert ex.messages[-1]["role"] == "user"
    return ex.messages[-1]["content"]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


# ------------------------------------------------------------------------------------------------- config


def test_every_config_field_has_a_default_and_help() -> None:
    for f in fields(TaskConfig):
        assert f.metadata.get("help"), f.name
    TaskConfig()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"name": ""}, "task.name"),
        ({"operators": "+/"}, "task.operators"),
        ({"num_operands": 1}, "task.num_operands"),
        ({"min_digits": 3, "max_digits": 2}, "task.min_digits"),
        ({"num_query": 4, "num_facts": 3}, "task.num_query"),
        ({"format_weight": 1.5}, "task.format_weight"),
        ({"reward_timeout": 0}, "task.reward_timeout"),
        ({"num_examples": 0}, "task.num_examples"),
    ],
)
def test_config_errors_name_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(key)):
        TaskConfig(**overrides)


def test_tasks_are_a_registry_that_leaves_task_names_alone() -> None:
    """The built-in tasks are the registry's first entries (tasks/config.py's list for the config is the same),
    and a factory registered under a new name is selected by it without renaming its Task class."""
    assert isinstance(TASKS, Registry) and tuple(TASKS)[: len(BUILTIN_TASKS)] == BUILTIN_TASKS
    register_task("sums")(ArithmeticTask)
    try:
        task = make_task(TaskConfig(name="sums"))
        assert isinstance(task, ArithmeticTask) and task.name == "arithmetic"
    finally:
        del TASKS["sums"]


def test_unknown_task_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="arithmetic.*long_arithmetic"):
        make_task(TaskConfig(name="algebra"))


# --------------------------------------------------------------------------------------------- arithmetic


def test_arithmetic_easiest_setting_is_two_small_addends() -> None:
    task = make_task(TaskConfig())
    assert len(task) == 10000
    for ex in [task[i] for i in range(200)]:
        m = re.fullmatch(r"What is (\d+) \+ (\d+)\?\n" + re.escape(BOXED_INSTRUCTION), user_text(ex))
        assert m, user_text(ex)
        a, b = int(m.group(1)), int(m.group(2))
        assert a < 100 and b < 100
        assert ex.answer == str(a + b)
        assert task.reward(f"\\boxed{{{a + b}}}", ex) == 1.0
        assert task.reward(f"\\boxed{{{a + b + 1}}}", ex) == 0.0


def test_arithmetic_is_deterministic_by_seed_and_split() -> None:
    cfg = TaskConfig(num_operands=4, min_digits=2, max_digits=3, operators="+-*")
    first = [make_task(cfg)[i] for i in range(20)]
    again = make_task(cfg)
    assert [again[i] for i in reversed(range(20))][::-1] == first  # any access order
    assert [make_task(TaskConfig(**{**vars(cfg), "seed": 1}))[i] for i in range(20)] != first
    assert [make_task(cfg, split="test")[i] for i in range(20)] != first
    assert make_task(cfg)[-1] == make_task(cfg)[len(make_task(cfg)) - 1]
    with pytest.raises(IndexError, match="num_examples"):
        make_task(cfg)[10000]


def test_arithmetic_difficulty_knobs() -> None:
    cfg = TaskConfig(num_operands=4, min_digits=3, max_digits=3, operators="-*", num_examples=50)
    for ex in make_task(cfg):
        expr = ex.meta["expression"]
        tokens = expr.split()
        operands, operators = [int(t) for t in tokens[::2]], tokens[1::2]
        assert len(operands) == 4 and all(100 <= x <= 999 for x in operands)
        assert set(operators) <= {"-", "*"}
        assert int(ex.answer) == eval(expr)  # noqa: S307 (our own digits-and-operators string)
        assert evaluate(operands, operators) == int(ex.answer)


def test_system_prompt_option() -> None:
    ex = make_task(TaskConfig(system_prompt="Be brief."))[0]
    assert ex.messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in make_task(TaskConfig())[0].messages] == ["user"]


# ---------------------------------------------------------------------------------------- long arithmetic


def test_long_arithmetic_needs_the_opening_facts() -> None:
    cfg = TaskConfig(name="long_arithmetic", num_facts=4, num_query=3, num_distractors=60, operators="+-")
    task = make_task(cfg)
    for ex in [task[i] for i in range(30)]:
        lines = user_text(ex).split("\n")
        defined = dict(re.findall(r"^Let (\w+) = (\d+)\.$", "\n".join(lines[1:5]), flags=re.M))
        assert len(defined) == 4 and set(defined) <= set(FACT_NAMES)
        question = next(line for line in lines if line.startswith("Question:"))
        assert lines.index(question) == len(lines) - 2  # at the end, before the instruction
        expr = question.split("what is ")[1].rstrip("?")
        names = expr.split()[::2]
        assert len(names) == 3 and set(names) <= set(defined)
        # Queried values are defined once, at the start, and never touched by the filler.
        filler = "\n".join(lines[5:-2])
        assert len(lines[5:-2]) == 60
        assert not any(re.search(rf"\b{n}\b", filler) for n in names)
        value = eval(" ".join(defined.get(t, t) for t in expr.split()))  # noqa: S307
        assert ex.answer == str(value)
        assert ex.meta["facts"] == {n: int(defined[n]) for n in names}
        assert task.reward(f"\\boxed{{{value}}}", ex) == 1.0


def test_long_arithmetic_length_and_determinism() -> None:
    short = make_task(TaskConfig(name="long_arithmetic", num_distractors=10))[0]
    long = make_task(TaskConfig(name="long_arithmetic", num_distractors=200))[0]
    assert len(user_text(long)) > 8 * len(user_text(short))
    cfg = TaskConfig(name="long_arithmetic", seed=3)
    assert make_task(cfg)[7] == make_task(cfg)[7]
    assert make_task(cfg)[7] != make_task(TaskConfig(name="long_arithmetic", seed=4))[7]


# ---------------------------------------------------------------------------------------- local datasets


@pytest.mark.shared_data
@pytest.mark.parametrize(
    ("file", "rows", "question_key", "answer_key", "first_answer"),
    [
        ("eval/math500.jsonl", 500, "problem", "answer", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("eval/aime24.jsonl", 30, "problem", "answer", "204"),
        ("eval/amc23.jsonl", 40, "problem", "answer", "27"),
        ("eval/gaokao2023en.jsonl", 383, "question", "answer", "\\{x|-2\\leq x < 1\\}"),
        ("eval/minerva_math.jsonl", 272, "problem", "solution", "1.6"),
        ("eval/olympiadbench.jsonl", 675, "question", "final_answer", "2"),
        ("gsm8k/test.jsonl", 1319, "question", "answer", "18"),
    ],
)
def test_eval_file_field_mapping(
    file: str, rows: int, question_key: str, answer_key: str, first_answer: str
) -> None:
    task = make_task(TaskConfig(name=str(DATA / file)), split="test")
    assert isinstance(task, DatasetTask)
    assert (len(task), task.question_key, task.answer_key) == (rows, question_key, answer_key)
    ex = task[0]
    assert ex.answer == first_answer
    assert user_text(ex).endswith("\n" + BOXED_INSTRUCTION)
    assert ex.meta["source"] == f"{DATA / file}:1"
    assert task.score(f"So the answer is $\\boxed{{{ex.answer}}}$.", ex) == 1.0
    assert task.score("So the answer is $\\boxed{123456}$.", ex) == 0.0


@pytest.mark.shared_data
def test_gsm8k_and_math_tasks_from_local_files(tmp_path: Path) -> None:
    gsm = make_task(TaskConfig(name="gsm8k", data=str(DATA / "gsm8k" / "{split}.jsonl")), split="train")
    assert len(gsm) == 7473 and gsm[0].answer == "72"
    test_answers = {
        ex.answer for ex in make_task(TaskConfig(name="gsm8k", data=str(DATA / "gsm8k/test.jsonl")))
    }
    assert "1450000" in test_answers and not any("," in a for a in test_answers)  # '#### 1,450,000'
    math = make_task(TaskConfig(name="math", data=str(DATA / "math/simplelr_level3to5_train.jsonl")))
    assert len(math) == 8521 and len(math.skipped) == 2 and math.skipped[0].endswith(":5055")
    ex = math[0]
    assert [m["role"] for m in ex.messages] == ["system", "user"]
    assert ex.answer == "118"
    assert "\\boxed{}" in user_text(ex) and "\\boxed{{}}" not in user_text(ex)
    assert user_text(ex).count("\\boxed") == 1  # the instruction is not added twice
    sys_cfg = TaskConfig(
        name="math", data=str(DATA / "math/simplelr_level3to5_train.jsonl"), system_prompt="S"
    )
    assert make_task(sys_cfg)[0].messages[0] == {"role": "system", "content": "S"}
    capped = make_task(
        TaskConfig(name="math", data=str(DATA / "math/simplelr_level3to5_train.jsonl"), max_examples=5)
    )
    assert len(capped) == 5


def test_field_overrides_nested_keys_and_split_placeholder(tmp_path: Path) -> None:
    rows = [
        {"q": "What is 2+2?", "extra": {"gold": "4"}, "level": 1},
        {"q": "What is 3+3?", "extra": {"gold": 6.0}, "level": 2},
    ]
    write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = TaskConfig(
        name="custom", data=str(tmp_path / "{split}.jsonl"), question_key="q", answer_key="extra.gold"
    )
    task = make_task(cfg)
    assert [ex.answer for ex in task] == ["4", "6"]
    assert task[1].meta["level"] == 2 and task[1].meta["source"].endswith("train.jsonl:2")
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        make_task(cfg, split="test")


def test_json_array_and_parquet_sources(tmp_path: Path) -> None:
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    assert [ex.answer for ex in make_task(TaskConfig(name=str(tmp_path / "d.json")))] == ["2", "4"]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows + [{"problem": "3+3?", "answer": None}]), tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'd.parquet'} row 3")):
        make_task(TaskConfig(name=str(tmp_path / "d.parquet")))


# -------------------------------------------------------------------------------------------- bad rows


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ('{"question": "3+3?", "answer": "#### 6"', "not valid JSON"),
        ({"question": "3+3?"}, "missing field 'answer'"),
        ({"question": "3+3?", "answer": None}, "field 'answer'"),
        ({"question": 7, "answer": "6"}, "field 'question'"),
        ({"question": [{"role": "assistant", "content": "hi"}], "answer": "6"}, "last chat message"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path: Path, bad_row: object, message: str) -> None:
    good = {"question": "1+1?", "answer": "#### 2"}
    path = write_jsonl(
        tmp_path / "rows.jsonl", [good, "", bad_row if isinstance(bad_row, str) else json.dumps(bad_row)]
    )
    with pytest.raises(ValueError, match=re.escape(f"{path}:3")) as err:
        make_task(TaskConfig(name="gsm8k", data=str(path)))
    assert message in str(err.value)


def test_solution_without_final_answer_is_an_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "solution": "we get 3"}])
    with pytest.raises(ValueError, match=re.escape(f"{path}:1") + ".*no \\\\boxed"):
        make_task(TaskConfig(name=str(path)))


def test_undetectable_fields_suggest_the_override(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "x.jsonl", [{"text": "p", "answer": "1"}])
    with pytest.raises(ValueError, match=re.escape(f"{path}:1") + ".*task.question_key"):
        make_task(TaskConfig(name=str(path)))


def test_hugging_face_names_go_through_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    from sparserl.tasks import dataset

    # the Hub answers here (tests/test_hub.py: when it does not)
    monkeypatch.setattr(dataset, "hub_offline", lambda: False)
    calls = []

    def fake_load_dataset(name: str, config: str | None = None, split: str | None = None) -> list[dict]:
        calls.append((name, config, split))
        return [{"question": "Two plus two?", "answer": "Easy.\n#### 4"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = make_task(TaskConfig(name="gsm8k"), split="test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert task[0].answer == "4" and task[0].meta["source"] == "openai/gsm8k[test] row 1"
    make_task(TaskConfig(name="someone/dataset", split="validation"))
    assert calls[-1] == ("someone/dataset", None, "validation")

    def failing(*args: object, **kwargs: object) -> None:
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(ValueError, match="'someone/other'.*offline"):
        make_task(TaskConfig(name="someone/other"))


# ------------------------------------------------------------------------ prompt templates, gold answers


def test_prompt_template_joins_context_and_question(tmp_path: Path) -> None:
    rows = [
        {
            "body": "Tom has 3 apples and buys 6 more.",
            "question": "How many?",
            "answer": "9 (apples)",
            "n": {"k": 1},
        },
        {"body": "A rod is 10 cm.", "question": "How long are 1.5 rods?", "answer": "15 cm", "n": {"k": 2}},
    ]
    path = write_jsonl(tmp_path / "wp.jsonl", rows)
    task = make_task(TaskConfig(name=str(path), prompt_template="{body} {question}"))
    assert user_text(task[0]) == f"{rows[0]['body']} {rows[0]['question']}\n{BOXED_INSTRUCTION}"
    assert [ex.answer for ex in task] == ["9", "15"]
    assert task.score("So \\boxed{9}.", task[0]) == 1.0 and task.score("\\boxed{15}", task[1]) == 1.0
    assert task[1].where == f"{path}:2" and task[1].row == rows[1]
    nested = make_task(TaskConfig(name=str(path), prompt_template="{question} (x{n.k})"))
    assert user_text(nested[1]).startswith("How long are 1.5 rods? (x2)\n")


def test_prompt_template_unknown_field_names_file_line_and_fields(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "wp.jsonl", [{"question": "q?", "answer": "1"}, {"question": "r?", "answer": "2"}]
    )
    with pytest.raises(DataError, match=re.escape(f"{path}:1") + r".*'body'.*question, answer"):
        make_task(TaskConfig(name=str(path), prompt_template="{body} {question}"))
    with pytest.raises(DataError, match=re.escape(f"{path}:1") + r".*'extra\.n'"):
        make_task(TaskConfig(name=str(path), prompt_template="{question} {extra.n}"))


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{body", "malformed"),
        ("no fields", "must name row fields"),
        ("{} {question}", "must name row fields"),
    ],
)
def test_malformed_prompt_template_names_the_key(template: str, message: str) -> None:
    with pytest.raises(UserError, match=r"task\.prompt_template.*" + message):
        TaskConfig(name="x.jsonl", prompt_template=template)


def test_auto_detection_reports_ignored_text_fields_once_per_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        {"question": "How many apples?", "context": None, "answer": "9"},
        {
            "question": "How long?",
            "context": "A rod is 10 cm long.",
            "answer": "10",
            "id": "r-2",
            "topic": "Plane Geometry",
        },
    ]
    path = write_jsonl(tmp_path / "ctx.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="sparserl.tasks.dataset"):
        make_task(TaskConfig(name=str(path)))
        make_task(TaskConfig(name=str(path)), split="test")
    notes = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(notes) == 1, notes
    assert "'question'" in notes[0] and "'answer'" in notes[0] and "'context'" in notes[0]
    assert "'id'" not in notes[0] and "'topic'" not in notes[0] and "task.prompt_template" in notes[0]
    caplog.clear()
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"question": "q?", "answer": "1", "solution": "it is 1"}])
    with caplog.at_level(logging.WARNING, logger="sparserl.tasks.dataset"):
        make_task(TaskConfig(name=str(plain)))
    assert not caplog.records  # nothing unused but another reference field


@pytest.mark.parametrize(
    ("gold", "expected"),
    [
        ("9 (apples)", "9"),
        ("15 cm", "15"),
        ("$1,200.50", "1200.50"),
        ("\\$18", "18"),
        ("12 km/h", "12"),
        ("3.5 hours.", "3.5"),
        ("-4 degrees", "-4"),
        ("3/4 cup", "3/4"),
        ("1,000 people", "1000"),
        # real math stays intact
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("x^2+1", "x^2+1"),
        ("(1, 2)", "(1, 2)"),
        ("[1, 2)", "[1, 2)"),
        ("1, 2", "1, 2"),
        ("1,200", "1,200"),
        ("2 \\sqrt{3}", "2 \\sqrt{3}"),
        ("3 pi", "3 pi"),
        ("2 x", "2 x"),
        ("2x", "2x"),
        ("10\\%", "10\\%"),
        ("5 \\text{ cm}", "5 \\text{ cm}"),
        ("12 dollars and 50 cents", "12 dollars and 50 cents"),
        ("9 (2)", "9 (2)"),
        ("9 (from 4+5)", "9"),
        ("42 (the sum of 40 and 2)", "42"),
        ("9 (x+1)", "9 (x+1)"),
        ("3 (mod 5)", "3 (mod 5)"),
        ("$5$", "5"),
        ("B", "B"),
    ],
)
def test_gold_answer_drops_units_and_keeps_math(gold: str, expected: str) -> None:
    assert reference_answer(gold) == expected
    assert reference_answer(f"so the answer is \\boxed{{{gold}}}") == expected


def test_eval_task_config_takes_the_prompt_template_and_drops_reward_shaping(tmp_path: Path) -> None:
    from sparserl.eval.loading import eval_task_config

    path = write_jsonl(
        tmp_path / "wp.jsonl", [{"body": "Tom has 9 apples.", "question": "How many?", "answer": "9"}]
    )
    run_task = TaskConfig(reward=["builtin", "mod:f"], reward_weights=[1.0, 0.1], format_weight=0.2)
    cfg = eval_task_config(str(path), prompt_template="{body} {question}", base=run_task)
    assert (cfg.prompt_template, cfg.reward, cfg.reward_weights, cfg.format_weight) == (
        "{body} {question}",
        [],
        [],
        0.0,
    )
    task = make_task(cfg, "test")
    assert user_text(task[0]).startswith("Tom has 9 apples. How many?\n")
    assert task.score("\\boxed{9}", task[0]) == 1.0


def test_long_arithmetic_question_first_states_the_question_before_the_filler() -> None:
    cfg = TaskConfig(
        name="long_arithmetic", layout="question_first", num_facts=4, num_query=2, num_distractors=20
    )
    for i in range(5):
        ex = make_task(cfg)[i]
        lines = ex.messages[-1]["content"].splitlines()
        first = lines[0]
        assert first.startswith("Question: what is ") and not any(n in first for n in FACT_NAMES)
        a, b = (int(x) for x in first.removeprefix("Question: what is ").split("?")[0].split(" + "))
        assert ex.answer == str(a + b)
        assert any("answer the question asked at the start" in line for line in lines[-3:])
        assert not any(line.startswith("Let " + n + " ") for line in lines for n in FACT_NAMES)
    with pytest.raises(ValueError, match="task.layout='sideways'"):
        TaskConfig(name="long_arithmetic", layout="sideways")
