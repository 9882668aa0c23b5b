"""SIGTERM (job schedulers, `docker stop`, `kill`) handled like Ctrl-C, but giving long commands the chance to
stop cleanly: without a handler Python dies at once with exit code 143 and writes nothing.

`StopOnSignal` turns SIGTERM into a `Terminated` exception (a KeyboardInterrupt, so code that cleans up after
Ctrl-C cleans up after it too). While `deferring` is set (a training step in flight), the first SIGTERM only
records the request: the command finishes its unit of work, then calls `check()` at a safe point, which raises
`Terminated(at_safe_point=True)` so that it can save. A second SIGTERM raises at once (the step is abandoned).
A command ends with `Terminated.exit_code`, 128 + the signal number (143), as if the signal had killed it.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Terminated(KeyboardInterrupt):
    """The command was asked to stop by `signum`; `at_safe_point` when raised between units of work (the state
    is consistent and may be saved), else in the middle of one."""

    def __init__(self, signum: int, at_safe_point: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.at_safe_point = at_safe_point

    @property
    def exit_code(self) -> int:
        """The conventional exit status of a process ended by the signal: 128 + its number."""
        return 128 + self.signum

    @property
    def name(self) -> str:
        """'SIGTERM'."""
        return signal.Signals(self.signum).name


class StopOnSignal:
    """While entered (in the main thread), SIGTERM raises `Terminated`, or with `deferring` set only asks for
    a stop at the next `check()`; `notify(message)` is told of a deferred request. Restores the previous
    handler on exit. Elsewhere than in the main thread it does nothing (Python only handles signals there)."""

    def __init__(
        self, signals: tuple[int, ...] = (signal.SIGTERM,), notify: Callable[[str], None] | None = None
    ) -> None:
        self.signals = signals
        self.notify = notify
        self.deferring = False
        self.shielded = False  # set while saving after a stop: further signals are ignored
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.shielded:
            return
        if self.deferring and self.requested is None:
            self.requested = signum
            if self.notify is not None:
                name = signal.Signals(signum).name
                self.notify(
                    f"{name}: finishing the current step, then saving a checkpoint "
                    f"(send {name} again to stop at once, losing the step)"
                )
            return
        raise Terminated(signum)

    def check(self) -> None:
        """Raise `Terminated(at_safe_point=True)` if a stop was asked for; call it where the state may be saved."""
        if self.requested is not None:
            raise Terminated(self.requested, at_safe_point=True)


def stop_between_steps(trainer: Any, stop: StopOnSignal) -> None:
    """Make `trainer` honour `stop` between training steps through its `stop_check` hook (called before each
    step): a SIGTERM during a step lets it finish, and the next step's start raises
    `Terminated(at_safe_point=True)`."""
    trainer.stop_check = stop.check
    stop.deferring = True


def stoppable(command: str, lost: str, exits: bool = False) -> Callable[[F], F]:
    """Decorate a command's `main(...) -> exit code`: SIGTERM ends it with one line on stderr ('COMMAND:
    stopped by SIGTERM; LOST') and exit code 143, where Python would die silently. For commands with nothing
    worth saving half-way (a calibration, a benchmark, an experiment's part). With `exits`, the process exits
    with that code (for a script's `main()` that returns its results, not an exit code)."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with StopOnSignal():
                try:
                    return fn(*args, **kwargs)
                except Terminated as e:
                    print(f"{command}: stopped by {e.name}; {lost}", file=sys.stderr)
                    if exits:
                        sys.exit(e.exit_code)
                    return e.exit_code

        return wrapper  # type: ignore[return-value]

    return deco
