"""Bad input to the `sparserl` command, one table row per case: each must exit non-zero with ONE clear stderr
line naming the culprit, no traceback, and (for `train`) no empty run directory left under the output dir.

Adding a case is one line above the end marker of CASES:

    case("eval-missing-data", ["eval", *EVAL, "--data", "{tmp}/missing.jsonl"], 1, r"missing\\.jsonl"),

`{tmp}` in argv is replaced by the test's tmp_path (also the working directory). `setup(tmp)` may write files
first (see the `write` helpers). `message` is a regex searched in the `sparserl <command>: ...` error line.
`xfail="needs <file> fix"` marks a case waiting for a library-side change (strict: it must fail until then).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparserl.cli import EXIT_FAILURE, EXIT_USAGE, main

# Tiny train runs: a random 2-layer model, a few prompts and tokens, output under {tmp}/runs.
TRAIN = [
    "train",
    "model.spec=tiny-llama",
    "rollout.prompts_per_step=2",
    "rollout.n=2",
    "rollout.max_new_tokens=4",
    "kv.budget=24",
    "kv.interval=4",
    "trainer.eval_prompts=0",
    "task.num_examples=20",
    "trainer.steps=1",
    "logging.progress=false",
    "trainer.output_dir={tmp}/runs",
    "trainer.run_name=r",
]
# Tiny eval runs: the random test model, one prompt, one short sample.
EVAL = ["eval", "--model", "tiny-llama", "--limit", "1", "--samples", "1", "--max-new-tokens", "4", "-q"]
ROLLOUT = ["rollout", "--model", "tiny-llama", "--prompts", "1", "--n", "1", "--max-new-tokens", "4"]


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    """A setup writing `content` (text or raw bytes) to tmp/`name`."""

    def setup(tmp: Path) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return setup


def write_jsonl(name: str, rows: list[dict[str, Any]]) -> Callable[[Path], None]:
    """A setup writing `rows` as a .jsonl file tmp/`name`."""
    return write(name, "".join(json.dumps(r) + "\n" for r in rows))


def case(
    id: str,
    argv: list[str],
    code: int,
    message: str,
    setup: Callable[[Path], None] | None = None,
    xfail: str = "",
) -> Any:
    """One row of the table (a pytest.param with its id)."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(argv, code, message, setup, id=id, marks=marks)


def run_dirs(output_dir: Path) -> set[Path]:
    """Every directory under a train output dir."""
    return {p for p in output_dir.rglob("*") if p.is_dir()} if output_dir.is_dir() else set()


# ------------------------------------------------------------------------------------------------ the table

CASES = [
    case("train-unknown-key", [*TRAIN, "optim.learning_rate=1"], EXIT_USAGE, r"unknown config key 'optim\.learning_rate'"),
    case("eval-missing-data", [*EVAL, "--data", "{tmp}/missing.jsonl"], EXIT_FAILURE, r"missing\.jsonl"),
    # --- add new cases above this line ---
]  # fmt: skip


@pytest.mark.parametrize(("argv", "code", "message", "setup"), CASES)
def test_bad_input_is_one_clear_line(
    argv: list[str],
    code: int,
    message: str,
    setup: Callable[[Path], None] | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path)
    output_dir = tmp_path / "runs"
    dirs_before = run_dirs(output_dir)
    try:
        rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as e:  # argparse's usage errors: 'sparserl eval: error: ...' after the usage lines
        rc = e.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err, captured.err
    errors = [line for line in captured.err.splitlines() if line.startswith(f"sparserl {argv[0]}:")]
    assert rc == code, captured.err
    assert len(errors) == 1, captured.err
    assert re.search(message, errors[0]), errors[0]
    if argv[0] == "train":
        empty = [d for d in run_dirs(output_dir) - dirs_before if not any(p.is_file() for p in d.rglob("*"))]
        assert not empty, f"a failed start left empty directories: {empty}"
