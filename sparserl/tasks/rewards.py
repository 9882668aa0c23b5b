"""Verifiable rewards: equivalence of an extracted answer (tasks/answers.py) with the reference, fault guard.

Equivalence first tries an exact numeric comparison (fast, covers arithmetic and most GSM8K answers) and
otherwise asks math-verify. math-verify's own timeout uses `signal.alarm`, which only works in the main thread
and cannot interrupt a computation stuck in C (a huge power or factorial inside sympy), so its timeouts are
disabled and the call runs in a worker process (`sparserl.tasks._verify_worker`) that is killed and
restarted when it overruns. Any reward function can be wrapped with `safe_call`: an exception, an overrun or a
value that is not a finite number within +-MAX_ABS_REWARD scores 0 and is counted in `RewardStats`, which the
trainer logs. Users' reward functions run in a worker process of their own (`reward_process`).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparserl.tasks.answers import extract_answer, format_reward, numeric_match, parse_number, strip_dollars

logger = logging.getLogger(__name__)

# The largest reward magnitude taken as a reward: beyond it (1e200, or a sane reward times a huge
# task.reward_weights) a value is a bug, scores 0 and is counted; float32 advantages would overflow anyway.
MAX_ABS_REWARD = 1e6


class RewardTimeout(TimeoutError):
    """A reward computation overran its time limit."""


@dataclass
class RewardStats:
    """Counters of reward calls that failed; failures score 0. The trainer logs `as_metrics()`."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    crashes: int = 0  # of the errors: calls whose worker process ended (os._exit, a signal, a crash)
    last_error: str = ""

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """The counters as a flat metrics dict (`crashes` only once there is one)."""
        out = {
            f"{prefix}calls": float(self.calls),
            f"{prefix}errors": float(self.errors),
            f"{prefix}timeouts": float(self.timeouts),
        }
        if self.crashes:
            out[f"{prefix}crashes"] = float(self.crashes)
        return out

    def reset(self) -> None:
        """Zero the counters (e.g. after each logged step)."""
        self.calls = self.errors = self.timeouts = self.crashes = 0
        self.last_error = ""


# ------------------------------------------------------------------------------------------ math-verify


class _Spawner:
    """Starts worker processes from one daemon thread that lives as long as the process.

    The worker asks Linux to SIGKILL it when its parent dies (PR_SET_PDEATHSIG), the only way to reap it
    while it is stuck in C code that holds its GIL. Linux counts the *thread* that forked it as the parent,
    so a worker started by a short-lived thread (a custom task verifying from a thread pool) was killed when
    that thread ended. Forking from this thread ties the worker's life to the process instead."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Future, tuple, dict]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        """`subprocess.Popen(*args, **kwargs)`, run on the spawner thread (started on first use, and again
        in a forked child, where the parent's threads do not exist)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="sparserl-spawner", daemon=True)
                self._thread.start()
        future: Future = Future()
        self._requests.put((future, args, kwargs))
        return future.result()

    def _serve(self) -> None:
        """Run Popen requests until the process exits (the thread never returns)."""
        while True:
            future, args, kwargs = self._requests.get()
            try:
                future.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as e:  # re-raised in the caller
                future.set_exception(e)


_SPAWNER = _Spawner()


class MathVerifier:
    """math-verify `parse` + `verify` in a worker process, killable at a per-call deadline; thread-safe."""

    def __init__(self, startup_timeout: float = 120.0) -> None:
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the worker if it is not running (imports sympy: about a second). Raises if it cannot."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self._proc = _SPAWNER.popen(
            [sys.executable, "-m", "sparserl.tasks._verify_worker", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buf = b""
        try:
            reply = self._read_line(time.monotonic() + self.startup_timeout)
        except RewardTimeout:
            self._kill_locked()
            raise RuntimeError(
                f"the math-verify worker did not start within {self.startup_timeout:.0f}s"
            ) from None
        if reply is None or not json.loads(reply).get("ready"):
            self._kill_locked()
            raise RuntimeError(
                "the math-verify worker (python -m sparserl.tasks._verify_worker) failed to start; "
                "is math-verify installed?"
            )

    def _read_line(self, deadline: float) -> bytes | None:
        """One reply line from the worker before `deadline`; None if it exited; RewardTimeout if late."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RewardTimeout("math-verify overran its time limit")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _kill_locked(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc = None
        self._buf = b""

    def close(self) -> None:
        """Stop the worker (it is restarted on the next call)."""
        with self._lock:
            self._kill_locked()

    def equivalent(self, gold: str, pred: str, timeout: float = 5.0) -> bool:
        """math-verify's verdict on LaTeX answers `gold` and `pred`. Raises RewardTimeout past `timeout`
        seconds (the worker is killed) and RuntimeError if the worker fails."""
        with self._lock:
            self._start_locked()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps([gold, pred]).encode() + b"\n")
                self._proc.stdin.flush()
                line = self._read_line(time.monotonic() + wait_limit(timeout))
            except BaseException:
                self._kill_locked()
                raise
            if line is None:
                self._kill_locked()
                raise RuntimeError("the math-verify worker exited unexpectedly")
            reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"math-verify failed: {reply['error']}")
        return bool(reply["ok"])


_VERIFIER: MathVerifier | None = None
_VERIFIER_LOCK = threading.Lock()


def get_verifier() -> MathVerifier:
    """The process-wide math-verify worker (started lazily, stopped at exit)."""
    global _VERIFIER
    with _VERIFIER_LOCK:
        if _VERIFIER is None:
            _VERIFIER = MathVerifier()
            atexit.register(_VERIFIER.close)
        return _VERIFIER


def _canonical(answer: str) -> str:
    text = strip_dollars(answer)
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\ ", " "):
        text = text.replace(junk, "")
    return text


def _as_latex(answer: str) -> str:
    return "\\boxed{" + strip_dollars(answer) + "}"


def answers_match(gold: str, pred: str, timeout: float = 5.0, verifier: MathVerifier | None = None) -> bool:
    """Whether answer `pred` equals reference `gold`: exact numeric comparison, then identical text up to
    spacing and `\\left`/`\\right`, then math-verify
    (in the worker, at most `timeout` seconds; raises RewardTimeout past it)."""
    pred = pred.strip()
    if not pred:
        return False
    fast = numeric_match(gold, pred)
    if fast is not None:
        return fast
    if _canonical(gold) == _canonical(pred):  # also covers references math-verify cannot parse
        return True
    return (verifier or get_verifier()).equivalent(_as_latex(gold), _as_latex(pred), timeout=timeout)


def math_reward(completion_text: str, gold: str, format_weight: float = 0.0, timeout: float = 5.0) -> float:
    """(1 - w) * [extracted answer equals `gold`] + w * format_reward; 0 when no answer can be extracted."""
    pred = extract_answer(completion_text)
    correct = pred is not None and answers_match(gold, pred, timeout=timeout)
    fmt = format_reward(completion_text) if format_weight else 0.0
    return (1.0 - format_weight) * float(correct) + format_weight * fmt


def numeric_reward(completion_text: str, gold: str, format_weight: float = 0.0) -> float:
    """Like `math_reward` but the answer must be a plain number equal to `gold` (no math-verify, so an
    unevaluated expression such as `3+4` does not count)."""
    pred = extract_answer(completion_text)
    value = parse_number(pred) if pred is not None else None
    correct = value is not None and value == parse_number(gold)
    fmt = format_reward(completion_text) if format_weight else 0.0
    return (1.0 - format_weight) * float(correct) + format_weight * fmt


# ------------------------------------------------------------------------------------------------ guard

_MAX_LOGGED_ERRORS = 5


NO_DEADLINE = 1e7  # seconds (116 days): the longest wait for a reward call, what select and joins accept


def wait_limit(timeout: float | None) -> float:
    """Seconds to wait for a reward call: `timeout`, capped at NO_DEADLINE, so that None, inf or a huge
    task.reward_timeout all mean 'no limit'."""
    return NO_DEADLINE if timeout is None else min(timeout, NO_DEADLINE)


def call_with_deadline(fn: Callable[..., Any], args: tuple, timeout: float | None) -> Any:
    """`fn(*args)`; with `timeout`, in a daemon thread, raising RewardTimeout if it has not returned after
    `timeout` seconds (the thread is then abandoned: Python cannot kill it)."""
    if timeout is None:
        return fn(*args)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, name="sparserl-reward", daemon=True)
    t.start()
    t.join(wait_limit(timeout))
    if t.is_alive():
        raise RewardTimeout(f"reward function overran {timeout:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def usable_reward(value: float) -> bool:
    """Whether `value` is finite and within +-MAX_ABS_REWARD."""
    return math.isfinite(value) and abs(value) <= MAX_ABS_REWARD


def finite_reward(value: Any) -> float:
    """`float(value)`; ValueError when it is NaN, infinite or beyond +-MAX_ABS_REWARD (such a reward would
    poison the advantages)."""
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward is {reward}")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"reward is {reward:g}, beyond +-{MAX_ABS_REWARD:g}")
    return reward


def record_failure(
    stats: RewardStats, error: BaseException, count: int = 1, source: str = "reward", log: bool = True
) -> None:
    """Count `count` completions that scored 0 because `source` failed with `error` (a RewardTimeout is a
    timeout, anything else an error), and (with `log`) log the first few failures of each kind."""
    if isinstance(error, RewardTimeout):
        stats.timeouts += count
        stats.last_error = f"{source}: {error}"
        if log and stats.timeouts - count < _MAX_LOGGED_ERRORS:
            logger.warning("%s timed out (scored 0): %s", source, error)
    else:
        stats.errors += count
        stats.last_error = f"{source}: {type(error).__name__}: {error}"
        if log and stats.errors - count < _MAX_LOGGED_ERRORS:
            logger.warning("%s raised (scored 0): %s: %s", source, type(error).__name__, error)


def safe_call(fn: Callable[..., Any], *args: Any, timeout: float | None, stats: RewardStats) -> float:
    """`float(fn(*args))`, or 0.0 when it raises, returns a non-finite value, or (with `timeout`) runs past
    `timeout` seconds; each failure is counted in `stats` (a RewardTimeout raised inside counts as a
    timeout)."""
    stats.calls += 1
    try:
        return finite_reward(call_with_deadline(fn, args, timeout))
    except Exception as e:
        record_failure(stats, e)
        return 0.0
