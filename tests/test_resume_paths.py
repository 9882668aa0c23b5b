"""A run started with relative task.data, trainer.eval_data and task.reward=file.py:f on the command line stores
them resolved: it resumes from another working directory, and `sparserl eval RUN_DIR` reads
its data from there too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sparserl.cli import main
from sparserl.config import load_config
from tests.tiny import TINY_RUN

TINY = [
    *TINY_RUN,
    "rollout.max_new_tokens=4",
    "trainer.steps=1",
    "trainer.eval_prompts=1",
    "logging.progress=false",
    "logging.tensorboard=false",
]
QA = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is 2 + 2?", "answer": "4"}]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp/a with data/q.jsonl and rw.py (the working directory); tmp/b is another directory."""
    root = tmp_path / "a"
    (root / "data").mkdir(parents=True)
    (root / "data" / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA))
    (root / "rw.py").write_text("def f(completions, **kwargs):\n    return [0.5] * len(completions)\n")
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(root)
    return root


def test_command_line_paths_are_resolved(project: Path) -> None:
    cfg = load_config(
        None, ["task.data=data/q.jsonl", "trainer.eval_data=./data/q.jsonl", "task.reward=[builtin, rw.py:f]"]
    )
    assert cfg.task.data == cfg.task.name == str(project / "data" / "q.jsonl")
    assert cfg.trainer.eval_data == str(project / "data" / "q.jsonl")
    assert cfg.task.reward == ["builtin", f"{project / 'rw.py'}:f"]
    named = load_config(None, ["task.name=data/q.jsonl"])
    assert named.task.name == str(project / "data" / "q.jsonl")
    kept = load_config(None, ["task.data=openai/gsm8k", "task.reward=some.module:f"])  # not local files
    assert (kept.task.data, kept.task.reward) == ("openai/gsm8k", ["some.module:f"])


def test_relative_paths_resume_from_another_directory(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = ["task.data=data/q.jsonl", "trainer.eval_data=data/q.jsonl", "task.reward=rw.py:f"]
    run = project / "runs" / "r"
    assert main(["train", *TINY, *paths, "trainer.output_dir=runs", "trainer.run_name=r"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["task"]["data"] == str(project / "data" / "q.jsonl")
    monkeypatch.chdir(project.parent / "b")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "trainer.steps=2"]) == 0, capsys.readouterr().err
    assert (
        main(["eval", "--model", str(run), "--limit", "1", "--samples", "1", "--max-new-tokens", "4", "-q"])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report  # the run's own data, read from b/
    monkeypatch.chdir(project)  # passing the same relative paths again on resume names the same files
    assert main(["train", "--resume", str(run), *paths, "trainer.steps=3"]) == 0, capsys.readouterr().err
