"""The `sparserl` command: help, config errors, subcommand registration, a run, kill -9 and --resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparserl import cli
from sparserl.trainer import latest_checkpoint
from tests.tiny import TINY_RUN

TINY = [
    *TINY_RUN,
    "rollout.max_new_tokens=8",
    "trainer.eval_prompts=1",
    "task.num_examples=20",
]


def test_train_help_lists_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    from sparserl.config import iter_fields

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for path, _, _ in iter_fields():
        assert path in out
    assert "Per-sequence budget, prompt included" in out  # a help string, not only the names
    assert "sparse-rl" in out and "--resume" in out


def test_train_help_lists_the_registered_group_sources(capsys: pytest.CaptureFixture[str]) -> None:
    """sampling.method's choices come from GROUP_SOURCES, each with its docstring's summary: a source
    registered in a user's module is listed as the built-in ones are."""
    from sparserl.rollout import GROUP_SOURCES

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert f"group sources (sampling.method=NAME): {GROUP_SOURCES.described()}" in out
    assert "'dars' (extra samples for hard prompts in a second round (DARS))" in out


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == cli.EXIT_USAGE
    assert "train" in capsys.readouterr().out


def test_unknown_key_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "optim.learning_rate=1"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown config key 'optim.learning_rate'" in err and "lr, betas" in err
    assert "Traceback" not in err


def test_print_config_applies_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    assert cli.main(["train", "--print-config", "optim.lr=1e-5", "algo.preset=dense"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["optim"]["lr"] == 1e-5 and cfg["algo"]["preset"] == "dense"


def test_resume_with_config_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["train", "--resume", str(tmp_path), "--config", "default"]) == cli.EXIT_USAGE
    assert "--resume uses the run's own config.yaml" in capsys.readouterr().err


def test_resume_of_a_non_run_names_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["train", "--resume", str(tmp_path)]) == cli.EXIT_FAILURE
    assert str(tmp_path) in capsys.readouterr().err


def test_registering_a_subcommand_is_one_function(capsys: pytest.CaptureFixture[str]) -> None:
    @cli.command("hello", "Say hello.", cli.arg("name"), cli.arg("--times", type=int, default=1))
    def hello(args) -> int:
        print(" ".join(["hello " + args.name] * args.times))
        return 0

    try:
        assert cli.main(["hello", "world", "--times", "2"]) == 0
        assert capsys.readouterr().out.strip() == "hello world hello world"
        with pytest.raises(ValueError, match="registered twice"):
            cli.command("hello", "again")(hello)
    finally:
        del cli.COMMANDS["hello"]


def test_train_runs_and_summarises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", *TINY, "trainer.steps=2", f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "run summary" in err and "KV memory saved" in err and "rejection rate" in err
    assert str(tmp_path / "r") in err
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["steps"] == 2
    # a finished run can be extended with --resume and a larger trainer.steps
    assert cli.main(["train", "--resume", str(tmp_path / "r"), "trainer.steps=3"]) == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 3
    # a bare --resume picks the newest run under trainer.output_dir
    assert cli.main(["train", "--resume", f"trainer.output_dir={tmp_path}", "trainer.steps=4"]) == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 4
    # a fresh run into the same directory is refused with the way out
    assert cli.main(args) == cli.EXIT_FAILURE
    assert "--resume" in capsys.readouterr().err


def test_kill_9_then_resume(tmp_path: Path) -> None:
    """A real SIGKILL while training: the resume loses at most the step in flight and finishes the run."""
    run = tmp_path / "k"
    cmd = [sys.executable, "-m", "sparserl.cli", "train", *TINY, "trainer.steps=40", "trainer.eval_prompts=0"]
    cmd += [f"trainer.output_dir={tmp_path}", "trainer.run_name=k", "logging.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            ck = latest_checkpoint(run)
            if ck is not None and int(ck.name.split("-")[1]) >= 2:
                break
            if proc.poll() is not None:
                pytest.fail(f"training exited early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint appeared in time")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = int(latest_checkpoint(run).name.split("-")[1])
    assert killed_at < 40
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparserl.cli",
            "train",
            "--resume",
            str(run),
            f"trainer.steps={killed_at + 1}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"resumed from {run / 'checkpoints'}" in out.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == killed_at + 1 and len(steps) == len(set(steps))


def interrupt_at_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Make training stop with Ctrl-C (KeyboardInterrupt) when it starts rollout step `step`."""
    from sparserl.trainer import Trainer

    rollout = Trainer.rollout

    def interrupted(self, at: int, *args, **kwargs):
        if at == step:
            raise KeyboardInterrupt
        return rollout(self, at, *args, **kwargs)

    monkeypatch.setattr(Trainer, "rollout", interrupted)


def test_ctrl_c_before_the_first_checkpoint_says_nothing_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No checkpoint yet: no `--resume` hint (it would fail); the same command starts again."""
    args = ["train", *TINY, "trainer.steps=1", f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    with monkeypatch.context() as patch:
        interrupt_at_step(patch, 1)
        assert cli.main(args) == cli.EXIT_INTERRUPTED
    err = " ".join(capsys.readouterr().err.split())
    assert "nothing was saved" in err and "run the same command to start again" in err
    assert "--resume" not in err
    assert cli.main(args) == 0, capsys.readouterr().err


def test_ctrl_c_after_a_checkpoint_names_the_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", *TINY, "trainer.steps=3", "trainer.save_every=1", "trainer.eval_prompts=0"]
    interrupt_at_step(monkeypatch, 2)
    assert cli.main([*args, f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]) == cli.EXIT_INTERRUPTED
    err = " ".join(capsys.readouterr().err.split())
    assert f"step-000001 was saved; continue with: sparserl train --resume {tmp_path / 'r'}" in err
