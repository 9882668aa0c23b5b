"""SIGTERM (schedulers, `docker stop`): `sparserl train` finishes the step in flight, writes a checkpoint, says how
to resume and exits 143; the resumed run ends with the very weights of an uninterrupted one. `sparserl
calibrate` and the other commands stop with one line and 143, not a silent death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparserl.signals import StopOnSignal, Terminated, stoppable
from sparserl.trainer import latest_checkpoint
from tests.tiny import TINY_RUN

# A reward that marks each call in a file and takes a moment, so that the test can signal mid-step.
SLOW_REWARD = """
import pathlib
import time

MARKS = pathlib.Path(__file__).with_name("marks.txt")


def slow(completions, **kwargs):
    with MARKS.open("a") as f:
        f.write("call\\n")
    time.sleep(0.25)
    return [float(len(c) % 3) for c in completions]
"""
TINY = [
    *TINY_RUN,
    "rollout.max_new_tokens=8",
    "trainer.eval_prompts=0",
    "task.num_examples=20",
    "trainer.steps=3",
    "logging.progress=false",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "sparserl.cli", "train", *extra]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    files = sorted((run / "final").glob("*.safetensors"))
    assert files, f"no exported weights in {run / 'final'}"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def test_sigterm_mid_step_saves_and_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    reward = tmp_path / "slow.py"
    reward.write_text(SLOW_REWARD)
    marks = tmp_path / "marks.txt"
    common = [*TINY, f"task.reward=[{reward}:slow]", f"trainer.output_dir={tmp_path}"]

    whole = subprocess.run(
        train_cmd(*common, "trainer.run_name=whole"),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    calls_per_step = len(marks.read_text().splitlines()) // 3
    marks.unlink()

    run = tmp_path / "cut"
    proc = subprocess.Popen(
        train_cmd(*common, "trainer.run_name=cut"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=ENV,
        text=True,
    )
    try:
        deadline = time.time() + 240
        # the first reward call of step 2: the step is in flight
        while not (marks.is_file() and len(marks.read_text().splitlines()) > calls_per_step):
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"training ended or stalled before step 2: {proc.stderr.read()[-3000:]}")
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    err = " ".join(err.split())
    assert "finishing the current step" in err
    assert (
        f"stopped by SIGTERM after step 2; step-000002 was saved; continue with: sparserl train --resume {run}"
        in (err)
    ), err[-2000:]
    assert "Traceback" not in err
    assert latest_checkpoint(run).name == "step-000002"
    assert not (run / "final").exists()

    resumed = subprocess.run(
        train_cmd("--resume", str(run)), capture_output=True, text=True, env=ENV, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = final_weights(tmp_path / "whole"), final_weights(run)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_stop_on_signal_defers_once_then_stops_at_once() -> None:
    said: list[str] = []
    with StopOnSignal(notify=said.append) as stop:
        stop.deferring = True
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM and "finishing the current step" in said[0]
        with pytest.raises(Terminated) as second:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs here
        assert not second.value.at_safe_point and second.value.exit_code == 143
        with pytest.raises(Terminated) as checked:
            stop.check()
        assert checked.value.at_safe_point
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored


def test_calibrate_stops_with_one_line_and_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_calibrate import command_args

    import sparserl.eval.calibrate as calibration
    from sparserl.eval.calibrate_command import calibrate_command

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises here
        pytest.fail("SIGTERM did not stop the calibration")

    monkeypatch.setattr(calibration, "measure_unit", terminated)
    assert calibrate_command(command_args(tmp_path)) == 143
    err = capsys.readouterr().err
    assert "sparserl calibrate: stopped by SIGTERM" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "schedule.json").exists()


def test_other_commands_stop_with_one_line_and_143(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sparserl.eval.commands as commands
    from sparserl.cli import main

    def terminated(args: object) -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler raises here
        pytest.fail("SIGTERM did not stop sparserl eval")

    def unhandled(signum: int, frame: object) -> None:  # stands for Python's default: a silent death
        raise AssertionError("sparserl eval left SIGTERM unhandled")

    monkeypatch.setattr(commands, "eval_command", terminated)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        rc = main(["eval", "--data", "arithmetic"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert rc == 143
    assert capsys.readouterr().err.strip() == "sparserl eval: stopped by SIGTERM"


def test_stoppable_returns_the_signal_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    @stoppable("bench", "nothing written")
    def main() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
        return 0

    assert main() == 143
    assert "bench: stopped by SIGTERM; nothing written" in capsys.readouterr().err
    exiting = stoppable("bench", "nothing written", exits=True)(main.__wrapped__)  # a script's main()
    with pytest.raises(SystemExit) as stopped:
        exiting()
    assert stopped.value.code == 143
