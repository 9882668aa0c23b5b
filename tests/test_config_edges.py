"""The class, not the instances: every config field and every flag of eval, rollout,
calibrate, cost and plot, given its type's edge values (negative, zero, huge, NaN/inf, empty, wrong type, a
missing file, a directory, a file that is not UTF-8), either validates or is refused with a UserError (one line,
no traceback) naming the field or flag. Config fields are checked through load_config and the model checks
made before a run directory exists; a few accepted edge values also train one step on the tiny model."""

from __future__ import annotations

import argparse
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sparserl.cli import EXIT_FAILURE, EXIT_USAGE, build_parser, main
from sparserl.config import iter_fields, load_config
from sparserl.config.model_fit import check_fits_model
from sparserl.errors import UserError
from tests.tiny import TINY_RUN

TINY = [
    *TINY_RUN,
    "rollout.max_new_tokens=4",
    "trainer.eval_prompts=0",
    "task.num_examples=20",
    "trainer.steps=1",
    "logging.progress=false",
    "logging.tensorboard=false",
]
FILES = ("{tmp}/missing.jsonl", "{tmp}/a_dir", "{tmp}/latin1.jsonl", "{tmp}/latin1.yaml")
BY_TYPE = {
    "int": ["-1", "0", "9223372036854775807", "1e30", "1.5", "abc", ""],
    "float": ["-1", "0", "1e308", "inf", "-inf", "nan", "abc", ""],
    "bool": ["maybe", "2", ""],
    "str": ["", " ", "\u00e9\u00e8", *FILES],
    "str | None": ["", "null", "0", "-1", "1e30", *FILES],
    "list[str]": ["", "[]", "[1, [2]]", "a,,b", *FILES],
    "list[float]": ["", "[]", "[nan]", "[inf, -1]", "abc"],
    "list[int]": ["", "[]", "[-1]", "[1e30]", "abc"],
    "dict[str, float]": ["", "{}", "{a: nan}", "abc"],
    "Any": ["", "[]", "[[0, -1]]", "[[0, 1.0e30]]", "abc", *FILES],
}
FIELDS = list(iter_fields())


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Fail (rather than hang) when the body runs longer than `seconds`."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The edge-case files under tmp_path (also the working directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "caf\xe9?", "answer": "1"}\n')
    (tmp_path / "latin1.yaml").write_bytes(b"[[0, 64]] # caf\xe9\n")
    return tmp_path


def edge_values(type_name: str) -> list[str]:
    """The edge values of a field type ('T | None': T's and null)."""
    if type_name in BY_TYPE:
        return BY_TYPE[type_name]
    inner = type_name.removesuffix(" | None")
    return [*BY_TYPE[inner], "null"] if inner != type_name and inner in BY_TYPE else []


def test_every_field_is_covered() -> None:
    missing = sorted({tp for _, tp, _ in FIELDS if not edge_values(tp)})
    assert not missing, f"no edge values for config field types {missing}: add them to BY_TYPE"


@pytest.mark.parametrize(("key", "type_name"), [(k, t) for k, t, _ in FIELDS], ids=[k for k, _, _ in FIELDS])
def test_config_field_edges(key: str, type_name: str, files: Path) -> None:
    """Each edge value of the field validates (and passes the model checks) or is a UserError naming it."""
    leaf = key.rsplit(".", 1)[-1]
    for raw in edge_values(type_name):
        value = raw.replace("{tmp}", str(files))
        with time_limit(20):
            try:
                cfg = load_config(None, [*TINY, f"{key}={value}"])
                check_fits_model(cfg)
            except UserError as e:
                message = str(e)
                assert "\n" not in message.strip(), f"{key}={value!r}: a multi-line error: {message}"
                assert key in message or re.search(rf"\b{re.escape(leaf)}\b", message), (
                    f"{key}={value!r}: the error does not name the field: {message}"
                )


# A few accepted edge values, trained for one step end to end (the rest stop at validation above).
ACCEPTED = [
    "trainer.seed=9223372036854775807",
    "task.seed=9223372036854775807",
    "kv.budget=2147483647",
    "rollout.max_new_tokens=1",
    "optim.lr=0",
]


@pytest.mark.parametrize("override", ACCEPTED)
def test_accepted_edge_values_train_one_step(
    override: str, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with time_limit(120):
        rc = main(["train", *TINY, f"trainer.output_dir={files}/runs", "trainer.run_name=r", override])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert rc == 0, err


# ------------------------------------------------------------------------------------------------ CLI flags

BASE = {
    "eval": ["--model", "tiny-llama", "--data", "arithmetic", "--limit", "1", "--samples", "1",
             "--max-new-tokens", "4", "-q"],
    "rollout": ["--model", "tiny-llama", "--prompts", "1", "--n", "1", "--max-new-tokens", "4", "--show", "0"],
    "calibrate": ["--model", "tiny-llama", "--data", "arithmetic", "--prompts", "1", "--n", "1",
                  "--max-new-tokens", "8", "--budgets", "48", "-q"],
    "cost": ["--model", "tiny-llama", "--output-len", "64"],
    "plot": [],
}  # fmt: skip
FLAG_VALUES = {
    int: ["-1", "0", "9223372036854775807", "abc"],
    float: ["-1", "0", "inf", "nan", "abc"],
    str: ["", "-1", "{tmp}/missing.jsonl", "{tmp}/a_dir", "{tmp}/latin1.yaml"],
}
SKIP = {"--help", "--out", "-o"}  # --out is a destination (test_bad_input covers a bad one)


def _flags() -> list[tuple[str, str, type]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for name in BASE:
        for action in sub.choices[name]._actions:
            if not action.option_strings or action.nargs == 0 or action.option_strings[-1] in SKIP:
                continue
            kind = action.type if action.type in (int, float) else int if action.dest == "threads" else str
            out.append((name, max(action.option_strings, key=len), kind))
    return out


def _drop(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value (the edge value replaces it)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        else:
            out.append(a)
    return out


# Flags whose edge values still run away (memory or time) or fail deep in the engine, each with why; strict, so
# each row must be removed once it is fixed. None today: huge --samples/--n/--limit/--prompts, --max-new-tokens
# past the context and --top-logprobs past the vocabulary are refused up front (sparserl/eval/commands.py).
KNOWN: dict[str, str] = {}


def _flag_params() -> list[object]:
    return [
        pytest.param(c, f, k, id=f"{c} {f}", marks=[pytest.mark.xfail(strict=True, reason=KNOWN[f"{c} {f}"])]
                     if f"{c} {f}" in KNOWN else [])
        for c, f, k in _flags()
    ]  # fmt: skip


@pytest.mark.slow  # about two minutes: every flag of five commands, most of them running the tiny model
@pytest.mark.parametrize(("command", "flag", "kind"), _flag_params())
def test_cli_flag_edges(
    command: str, flag: str, kind: type, files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each edge value of a flag runs (bounded in time) or exits non-zero with one error line naming it."""
    for raw in FLAG_VALUES[kind]:
        value = raw.replace("{tmp}", str(files))
        argv = [command, *_drop(BASE[command], flag), f"{flag}={value}"]
        if command == "plot":
            argv = [command, str(files / "missing_run"), f"{flag}={value}"]
        with time_limit(60):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's usage errors
                rc = e.code
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err, f"{argv}: {captured.err}"
        if rc == 0:
            continue
        assert rc in (EXIT_USAGE, EXIT_FAILURE), f"{argv}: exit {rc}: {captured.err}"
        errors = [line for line in captured.err.splitlines() if line.startswith(f"sparserl {command}:")]
        assert len(errors) == 1, f"{argv}: {captured.err}"
