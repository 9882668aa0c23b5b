"""Users' reward code cannot take the trainer down: it runs in a worker process, and whatever it does (exit,
os._exit, SIGKILL of itself, a hang, a memory blow-up, huge floats) scores 0 for the completions affected,
is counted (reward/errors, reward/timeouts, reward/crashes), is said once, and the run goes on. A reward file
whose import fails or exits is a UserError naming it before training starts."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from sparserl.errors import UserError
from sparserl.tasks import TaskConfig, make_task, with_reward_fns
from sparserl.tasks.reward_fns import RewardFnTask

# Each function misbehaves on the completions containing "bad" and rewards the others 1.0.
HOSTILE_PY = """
import os
import signal
import sys
import time


def _ok(completions):
    return [1.0] * len(completions)


def exit0(completions, **kwargs):
    if any("bad" in c for c in completions):
        sys.exit(0)
    return _ok(completions)


def exit3(completions, **kwargs):
    if any("bad" in c for c in completions):
        sys.exit(3)
    return _ok(completions)


def bye(completions, **kwargs):
    if any("bad" in c for c in completions):
        raise SystemExit("bye")
    return _ok(completions)


def hard_exit(completions, **kwargs):
    if any("bad" in c for c in completions):
        os._exit(5)
    return _ok(completions)


def kill_self(completions, **kwargs):
    if any("bad" in c for c in completions):
        os.kill(os.getpid(), signal.SIGKILL)
    return _ok(completions)


def hang(completions, **kwargs):
    if any("bad" in c for c in completions):
        time.sleep(60)
    return _ok(completions)


def hog(completions, **kwargs):
    if any("bad" in c for c in completions):
        blocks = []
        while True:
            blocks.append(bytearray(64 << 20))
    return _ok(completions)


def huge(completions, **kwargs):
    return [1e200 if "bad" in c else 1.0 for c in completions]


def pid(completions, **kwargs):
    return [float(os.getpid())] * len(completions)
"""

# (function, scores of ["good", "bad", "good"], counters (errors, timeouts, crashes), words on the console).
# A raise or sys.exit is retried one completion at a time (only "bad" scores 0); an ended worker or an overrun
# is not (the whole call scores 0).
CASES = {
    "exit0": ([1.0, 0.0, 1.0], (1, 0, 0), "called sys.exit(0)"),
    "exit3": ([1.0, 0.0, 1.0], (1, 0, 0), "called sys.exit(3)"),
    "bye": ([1.0, 0.0, 1.0], (1, 0, 0), "called sys.exit('bye')"),
    "hard_exit": ([0.0, 0.0, 0.0], (3, 0, 3), "ended its process with exit code 5"),
    "kill_self": ([0.0, 0.0, 0.0], (3, 0, 3), "was killed by SIGKILL"),
    "hang": ([0.0, 0.0, 0.0], (0, 3, 0), "overran its 1s limit"),
    "hog": ([1.0, 0.0, 1.0], (1, 0, 0), "raised MemoryError"),
    "huge": ([1.0, 0.0, 1.0], (1, 0, 0), "returned '1e+200', not a usable reward"),
}


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPARSERL_REWARD_MEMORY", "256MiB")  # the hog's MemoryError comes quickly
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE_PY)
    return path


def counters(task: RewardFnTask) -> tuple[int, int, int]:
    return task.stats.errors, task.stats.timeouts, task.stats.crashes


@pytest.mark.parametrize("fn", list(CASES))
def test_hostile_reward_scores_zero_is_counted_and_said_once(
    hostile: Path, fn: str, caplog: pytest.LogCaptureFixture
) -> None:
    scores, counts, words = CASES[fn]
    timeout = 1.0 if fn == "hang" else 20.0  # room for the hog on a busy machine
    task = make_task(TaskConfig(reward=[f"{hostile}:{fn}"], reward_timeout=timeout))
    assert isinstance(task, RewardFnTask)
    ex = task[0]
    with caplog.at_level(logging.WARNING):
        assert task.score_batch(["good", "bad", "good"], [ex] * 3) == scores
        assert counters(task) == counts
        assert task.score_batch(["good", "bad"], [ex] * 2)[0] in (0.0, 1.0)  # again: not said twice
        assert task.score_batch(["good", "fine"], [ex] * 2) == [1.0, 1.0]  # the worker is back
    said = [r.getMessage() for r in caplog.records if f"{fn}" in r.getMessage()]
    assert len(said) == 1 and words in said[0], said
    task.close()


def test_rewards_run_in_a_worker_process(hostile: Path) -> None:
    task = make_task(TaskConfig(reward=[f"{hostile}:pid"]))
    (worker,) = set(task.score_batch(["a", "b"], [task[0]] * 2))
    assert worker != os.getpid()
    task.close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("import sys\nsys.exit(4)\n", r"importing .*bad_import\.py called sys\.exit\(4\)"),
        ("raise SystemExit('no')\n", r"importing .*bad_import\.py called sys\.exit\('no'\)"),
        ("import os\nos._exit(7)\n", r"importing .*bad_import\.py ended its process with exit code 7"),
        ("raise RuntimeError('broken')\n", r"importing .*bad_import\.py failed: RuntimeError: broken"),
    ],
)
def test_a_reward_file_that_exits_at_import_is_an_error_naming_it(
    tmp_path: Path, body: str, message: str
) -> None:
    path = tmp_path / "bad_import.py"
    path.write_text(body + "def f(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    spec = f"{path}:f"
    with pytest.raises(UserError, match=re.escape(f"task.reward={spec!r}") + ".*" + message):
        make_task(TaskConfig(reward=[spec]))


def module_level_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Importable by reference: sent to the worker."""
    if any("bad" in c for c in completions):
        os._exit(9)
    return [float(os.getpid())] * len(completions)


def test_module_level_python_function_is_isolated_and_a_lambda_runs_in_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = make_task(TaskConfig())
    task = with_reward_fns(base, module_level_reward)
    (worker,) = set(task.score_batch(["a", "b"], [task[0]] * 2))
    assert worker != os.getpid()
    assert task.score_batch(["bad"], [task[0]]) == [0.0] and task.stats.crashes == 1
    task.close()
    with caplog.at_level(logging.WARNING):
        local = with_reward_fns(base, lambda completions, **kw: [float(os.getpid())] * len(completions))
        assert local.score_batch(["a"], [local[0]]) == [float(os.getpid())]
        exits = with_reward_fns(base, lambda completions, **kw: __import__("sys").exit(2))
        assert exits.score_batch(["a", "b"], [exits[0]] * 2) == [0.0, 0.0]  # SystemExit caught in-process
    assert any("runs in the trainer's process" in r.getMessage() for r in caplog.records)


# Reward code that starts processes, each writing its pid to pids.txt: they must not outlive the worker.
SPAWNING_PY = """
import os
import subprocess
import sys
import time

PIDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pids.txt")


def _sleeper(**popen):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], **popen)
    with open(PIDS, "a") as f:
        f.write(f"{proc.pid}\\n")


if os.environ.get("FORK_AT_IMPORT"):
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    with open(PIDS, "a") as f:
        f.write(f"{pid}\\n")


def per_call(completions, **kwargs):
    _sleeper()
    return [1.0] * len(completions)


def daemon(completions, **kwargs):
    _sleeper(start_new_session=True)
    return [1.0] * len(completions)


def overrun(completions, **kwargs):
    _sleeper()
    time.sleep(60)
    return [1.0] * len(completions)
"""


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    ("fn", "env", "close"),
    [("per_call", "", True), ("per_call", "1", True), ("daemon", "", True), ("overrun", "", False)],
    ids=["forks-per-call", "forks-at-import", "daemonizes", "overruns-its-timeout"],
)
def test_processes_started_by_reward_code_end_with_its_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fn: str, env: str, close: bool
) -> None:
    """Whatever reward code starts (a fork at import, a subprocess per call, one in a session of its own) ends
    when the worker is closed; a call that overruns task.reward_timeout ends its subprocesses with the worker."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads /proc (Linux)")
    monkeypatch.setenv("FORK_AT_IMPORT", env)
    path = tmp_path / "spawning.py"
    path.write_text(SPAWNING_PY)
    task = make_task(TaskConfig(reward=[f"{path}:{fn}"], reward_timeout=3.0))
    task.score_batch(["a"], [task[0]])
    pids = [int(p) for p in (tmp_path / "pids.txt").read_text().split()]
    assert len(pids) == 1 + bool(env)
    if close:
        assert all(alive(p) for p in pids)
        task.close()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]
    task.close()


def spawning_run(tmp_path: Path) -> list[int]:
    """`sparserl train` (one tiny step) with a reward module that forks at import and a function that starts a
    subprocess per call; the pids those started (the command has exited when this returns)."""
    import subprocess
    import sys

    from tests.tiny import TINY_RUN

    path = tmp_path / "spawning.py"
    path.write_text(SPAWNING_PY)
    argv = [*TINY_RUN, "rollout.max_new_tokens=4", "trainer.eval_prompts=0", "task.num_examples=20",
            "trainer.steps=1", "logging.progress=false", f"trainer.output_dir={tmp_path}/runs",
            f"task.reward=[builtin, {path}:per_call]"]  # fmt: skip
    env = {**os.environ, "FORK_AT_IMPORT": "1", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "log.txt"
    with log.open("w") as out:  # a file, not a pipe: waiting for a pipe's end would wait for the survivors
        done = subprocess.run([sys.executable, "-m", "sparserl.cli", "train", *argv], env=env, stdout=out,
                              stderr=out, timeout=300, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0, log.read_text()[-2000:]
    return [int(p) for p in (tmp_path / "pids.txt").read_text().split()]


def test_no_process_started_by_reward_code_outlives_a_run(tmp_path: Path) -> None:
    """Once `sparserl train` has exited, none of the processes its reward code started is alive."""
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads /proc (Linux)")
    pids = spawning_run(tmp_path)
    assert len(pids) >= 2
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


@pytest.mark.parametrize("limit", ["inf", "1e12"])
def test_a_reward_timeout_of_inf_means_no_limit(hostile: Path, limit: str) -> None:
    """task.reward_timeout=inf (or any huge number) is 'no limit': user rewards and the built-in math-verify
    one score as usual, with no error counted."""
    from sparserl.config import load_config

    cfg = load_config(None, [f"task.reward_timeout={limit}"]).task
    task = make_task(dataclasses.replace(cfg, reward=[f"{hostile}:exit0"]))
    assert task.score_batch(["good", "fine"], [task[0]] * 2) == [1.0, 1.0]
    builtin = make_task(cfg)
    ex = builtin[0]
    assert builtin.score_batch([f"\\boxed{{{ex.answer}}}"], [ex]) == [1.0]
    assert counters(task) == counters(builtin) == (0, 0, 0)
    task.close()


def test_huge_weights_score_zero_not_a_crash() -> None:
    from sparserl.rollout.rewards import task_rewards

    task = with_reward_fns(make_task(TaskConfig()), ["builtin"], weights=[1e300])
    ex = task[0]
    counts: dict[str, float] = {}
    rewards = task_rewards(task, [f"\\boxed{{{ex.answer}}}", "no"], [ex, ex], counts)
    assert rewards.tolist() == [0.0, 0.0] and counts["reward/errors"] == 1


def test_a_run_goes_on_and_counts_appear_in_the_metrics(tmp_path: Path) -> None:
    """Every hostile behaviour at once, on every completion, in a short training run: it ends normally, the
    built-in reward still counts, and its metrics count the failures."""
    from test_trainer import ParityTask, rows, tiny_cfg

    from sparserl.trainer import Trainer

    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE_PY.replace('"bad" in c', "True"))  # misbehave on every completion
    funcs = ["exit0", "exit3", "bye", "hard_exit", "kill_self", "hang", "huge"]
    cfg = tiny_cfg(tmp_path, "trainer.steps=2", "rollout.max_new_tokens=4", "trainer.eval_prompts=0")
    trainer = Trainer(cfg, task=ParityTask(), reward_fn=["builtin", *(f"{path}:{f}" for f in funcs)])
    trainer.task.reward_timeout = 0.5
    trainer.train()
    trainer.close()
    steps = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    last = steps[-1]
    n = 2 * 2 * 4  # steps x prompts x samples
    assert last["reward/timeouts"] == n  # hang
    assert last["reward/crashes"] == 2 * n  # hard_exit, kill_self
    assert last["reward/errors"] == 6 * n  # the above, exit0, exit3, bye, huge
    assert 0 <= last["reward/mean"] <= 1  # the built-in parity reward alone
