"""Users' reward functions in a worker process (`sparserl.tasks._reward_worker`), like math-verify's: whatever
a function does (raise, `sys.exit`, `os._exit`, kill itself, hang, exhaust memory) ends at most that worker,
which is restarted (its functions loaded again) on the next call. Thread-safe; one worker per instance.
The worker leads its own process group and adopts orphans, so whatever processes reward code starts end
with it (on a timeout, a crash, `close()` and at exit).

The worker's data segment is capped at $SPARSERL_REWARD_MEMORY (a size such as '8GiB'; '0' for no cap;
default half the machine's memory), so a memory blow-up is a MemoryError there, not the OOM killer's pick.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, BinaryIO

from sparserl.errors import UserError
from sparserl.tasks.rewards import _SPAWNER, RewardTimeout, wait_limit

LOAD_TIMEOUT = 300.0  # seconds an import of a user's reward module may take (it may load a model)
MEMORY_ENV = "SPARSERL_REWARD_MEMORY"
HEADER = struct.Struct(">Q")  # the length of each pickled message


def send(stream: BinaryIO, message: Any) -> None:
    """Write one length-prefixed pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """Read one length-prefixed pickle; None at end of input."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    data = stream.read(HEADER.unpack(head)[0])
    return pickle.loads(data)


class RewardCrash(RuntimeError):
    """The worker ended during a call (`os._exit`, a signal, a crash); `what` says how."""


class RewardRaised(RuntimeError):
    """A reward function raised (or called sys.exit) in the worker, which goes on; `str()` says what."""


def memory_limit() -> int:
    """Bytes of data the worker may hold: $SPARSERL_REWARD_MEMORY, else half the physical memory; 0: no cap."""
    from sparserl.sizes import size_in_bytes

    text = os.environ.get(MEMORY_ENV, "").strip()
    if text:
        try:
            return max(0, size_in_bytes(text))
        except ValueError:
            raise UserError(f"${MEMORY_ENV}={text!r} is not a size (e.g. 8GiB, or 0 for no cap)") from None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 0


def exit_description(returncode: int | None) -> str:
    """How the worker ended: 'ended its process with exit code 5', 'was killed by SIGKILL'."""
    if returncode is None:
        return "ended its process"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"ended its process with exit code {returncode} (os._exit?)"


def descendants(pid: int) -> list[int]:
    """The pids of `pid`'s living descendants (Linux's /proc; none elsewhere): what reward code started in
    the worker, found also where it left the worker's process group (the worker is their subreaper)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat") if sys.platform.startswith("linux") else ():
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the worker `pid`, its process group (it leads its own session) and every descendant: whatever
    the reward code started (a fork at import, a subprocess per call) ends with the worker."""
    for target in descendants(pid):
        with contextlib.suppress(OSError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def running(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the worker runs, found without reaping it: its pid stays its process group's id for kill_tree."""
    if proc.returncode is not None:
        return False
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


class _Handle:
    """The live worker; kept apart from RewardProcess so a finalizer can stop it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.buf = b""

    def kill(self) -> int | None:
        """Stop the worker; its exit status (None when there was none)."""
        proc, self.proc, self.buf = self.proc, None, b""
        if proc is None:
            return None
        if proc.returncode is None:  # not reaped yet, so its pid (= its process group) is still its own
            kill_tree(proc.pid)
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        return code


class RewardProcess:
    """Loads reward functions into a worker process and calls them there, each call under a deadline."""

    def __init__(self) -> None:
        self._handle = _Handle()
        self._loads: dict[str, tuple[str | bytes, str, list[str], str]] = {}
        self.asynchronous: set[str] = set()  # the loaded functions that are coroutine functions
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._handle.kill)

    def __getstate__(self) -> dict[str, Any]:
        """What crosses a process boundary (a task sent to a Ray rollout worker, which scores there): the
        functions to load, not the running worker; the copy starts its own on its first call and loads them."""
        return {"loads": dict(self._loads)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()
        self._loads = state["loads"]

    def start(self) -> None:
        """Start the worker and load every registered function now (RewardCrash names one that fails), so that
        a copy in another process finds out at once whether it can."""
        with self._lock:
            self._start_locked()

    # ------------------------------------------------------------------------------------------ process

    def _start_locked(self) -> None:
        """Start the worker and load every registered function again (after a restart)."""
        if self._handle.proc is not None and running(self._handle.proc):
            return
        self._handle.kill()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["SPARSERL_REWARD_MEMORY_BYTES"] = str(memory_limit())
        self._handle.proc = _SPAWNER.popen(
            [sys.executable, "-m", "sparserl.tasks._reward_worker", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, killed whole (kill_tree)
        )
        reply = self._exchange(None, LOAD_TIMEOUT)
        if reply != ("ready",):
            raise RewardCrash(f"the reward worker failed to start: {reply!r}")
        for key, entry in self._loads.items():
            reply = self._exchange(("load", key, *entry), LOAD_TIMEOUT)
            if reply[0] != "ok":
                raise RewardCrash(f"could not be loaded again in a new reward worker: {reply[1]}")

    def _read(self, n: int, deadline: float) -> bytes:
        """Exactly `n` bytes from the worker before `deadline` (RewardTimeout); RewardCrash if it ended."""
        proc = self._handle.proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        while len(self._handle.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RewardTimeout("overran")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise RewardCrash(exit_description(self._handle.kill()))
                self._handle.buf += chunk
        data, self._handle.buf = self._handle.buf[:n], self._handle.buf[n:]
        return data

    def _exchange(self, request: tuple | None, timeout: float) -> tuple:
        """Send `request` (None: only read) and return the reply. On a timeout or a crash the worker is
        stopped (restarted by the next call) and RewardTimeout / RewardCrash raised."""
        proc = self._handle.proc
        assert proc is not None and proc.stdin is not None
        try:
            if request is not None:
                try:
                    send(proc.stdin, request)
                except OSError:
                    raise RewardCrash(exit_description(self._handle.kill())) from None
            deadline = time.monotonic() + timeout
            size = HEADER.unpack(self._read(HEADER.size, deadline))[0]
            return pickle.loads(self._read(size, deadline))
        except RewardTimeout:
            self._handle.kill()
            raise
        except BaseException:
            if self._handle.proc is not None:
                self._handle.kill()
            raise

    # --------------------------------------------------------------------------------------------- API

    def load(
        self, key: str, source: str | bytes, style: str = "auto", what: str = "importing it"
    ) -> str | None:
        """Load `source` (a spec, or a function pickled by reference) as `key`, called in `style`
        (task.reward_style); None when it loaded, else what went wrong (an import that raised, exited or ended
        the process, a missing function, a signature that does not fit the style), the process's end or
        overrun described as `what` ... ('importing file.py ended its process ...')."""
        entry = (source, os.getcwd(), list(sys.path), style)
        with self._lock:
            self._start_locked()
            try:
                reply = self._exchange(("load", key, *entry), LOAD_TIMEOUT)
            except RewardTimeout:
                return f"{what} took longer than {LOAD_TIMEOUT:.0f}s"
            except RewardCrash as e:
                return f"{what} {e}"
            if reply[0] != "ok":
                return str(reply[1])
            self._loads[key] = entry
            if reply[1]:
                self.asynchronous.add(key)
        return None

    def call(self, key: str, call: Any, timeout: float | None) -> tuple:
        """Call function `key` on `call` (reward_styles.RewardCall) in the worker: its reply, `("values",
        [float | None | str], logs)`, `("count", what, logs)` or `("raised", what)` when the function raised or
        called sys.exit (reward_fns reads it). Raises RewardTimeout past `timeout` seconds and RewardCrash when
        the worker ends (both restart it on the next call)."""
        with self._lock:
            self._start_locked()
            return self._exchange(("call", key, call), wait_limit(timeout))

    def call_together(self, pairs: list[tuple[str, Any]], timeout: float | None) -> list[tuple]:
        """`call` for several (async) functions at once, awaited together in the worker: one reply each (a
        function that raised replies `("raised", what)`), under one `timeout` for all. RewardTimeout,
        RewardCrash and RewardRaised (awaiting them ended in sys.exit) concern the whole call."""
        with self._lock:
            self._start_locked()
            reply = self._exchange(("calls", pairs), wait_limit(timeout))
        if reply[0] == "raised":
            raise RewardRaised(reply[1])
        return reply[1]

    def close(self) -> None:
        """Stop the worker (a later call starts it again)."""
        with self._lock:
            self._handle.kill()
