"""Worker process of `reward_process.RewardProcess`: loads users' reward functions and calls them, so that
whatever they do (raise, `sys.exit`, `os._exit`, a signal, a hang, a memory blow-up) can only end this process.

Requests and replies are length-prefixed pickles on stdin / the original stdout (stray prints go to stderr):
- `("load", key, source, cwd, sys_path, style)`: `source` is a 'module:function' / 'file.py:function' spec or
  the pickle of a function (found by reference), `style` task.reward_style; replies `("ok", is_async)` or
  `("error", message)`;
- `("call", key, call)` (a reward_styles.RewardCall): replies `("values", [float | None | str], logs)` (a str
  says why that item is not a reward; `logs` what the function logged, RewardLogs), `("count", what, logs)`
  when the result is not a sequence, or `("raised", what)`. An `async def` function is awaited here.
- `("calls", [(key, call), ...])`: several async functions awaited together; replies `("replies", [reply])`,
  one `call` reply each (`("raised", what)` for the whole when awaiting them ended in sys.exit).
SIGINT and SIGTERM are ignored: a Ctrl-C or a scheduler's SIGTERM to the whole process group must not cut a
step short; the parent closes this worker (stdin EOF, or PR_SET_PDEATHSIG when the parent dies).
"""

from __future__ import annotations

import inspect
import os
import pickle
import sys
from typing import Any

from sparserl.tasks.reward_process import receive, send


def describe(error: BaseException) -> str:
    """What a reward function did, for the console: 'called sys.exit(3)', 'raised ValueError: ...'."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})" if error.code is not None else "called sys.exit()"
    return f"raised {type(error).__name__}: {error}"


def _limit_memory() -> None:
    """Cap this process's data segment at $SPARSERL_REWARD_MEMORY bytes (set by the parent; 0: no cap), so
    that a memory blow-up is a MemoryError here rather than the OOM killer choosing the trainer."""
    limit = int(os.environ.get("SPARSERL_REWARD_MEMORY_BYTES", "0") or 0)
    if limit <= 0:
        return
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass


def _adopt_orphans() -> None:
    """Become the subreaper of what reward code starts (Linux): a process it daemonizes stays this worker's
    descendant, so the parent finds and ends it with the worker (reward_process.kill_tree)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            pass


def _as_reward(value: Any) -> float | None | str:
    """A returned item as a float, None (does not apply), or a str saying why it is not a reward."""
    if value is None:
        return None
    try:
        return float(value)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which counts it
        return f"{type(e).__name__}: {e}"


def _load(source: str | bytes, style: str) -> tuple[Any, str]:
    """The function named by a spec, or unpickled (by reference) from the parent, and the style it is called
    in ('trl' or 'verl')."""
    from sparserl.tasks.reward_styles import resolve_style

    if isinstance(source, bytes):
        fn = pickle.loads(source)
    else:
        from sparserl.tasks.reward_loading import load_reward_function

        fn = load_reward_function(source)
    return fn, resolve_style(fn, style, getattr(fn, "__qualname__", repr(fn)))


def _call(loaded: tuple[Any, str], call: Any) -> tuple:
    from sparserl.tasks.reward_styles import invoke

    return _reply(*invoke(*loaded, call))


def _calls(functions: dict[str, Any], pairs: list[tuple[str, Any]]) -> tuple:
    """Several functions on their calls, the async ones awaited together: `("replies", [reply])`, each reply as
    a `call` request's."""
    from sparserl.tasks.reward_styles import invoke_together

    results = invoke_together([(*functions[key], call) for key, call in pairs])
    return ("replies", [("raised", describe(r)) if isinstance(r, Exception) else _reply(*r) for r in results])


def _reply(values: Any, logs: Any) -> tuple:
    """A function's result as the parent reads it: its items as rewards, or what it returned instead."""
    if isinstance(values, (str, bytes, dict)):
        return ("count", f"a {type(values).__name__}", logs)
    try:
        items = list(values)
    except TypeError:
        return ("count", f"a {type(values).__name__}", logs)
    return ("values", [_as_reward(v) for v in items], logs)


def main() -> None:
    """Serve requests until stdin closes (the parent pid is the first argument)."""
    from sparserl.tasks._verify_worker import _die_with_parent, ignore_interrupts

    _die_with_parent(int(sys.argv[1]) if len(sys.argv) > 1 else None)
    ignore_interrupts()
    _adopt_orphans()
    _limit_memory()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the reply stream
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    functions: dict[str, Any] = {}
    send(out, ("ready",))
    while (request := receive(inp)) is not None:
        op = request[0]
        try:
            if op == "load":
                _, key, source, cwd, path, style = request
                sys.path[:] = path
                os.chdir(cwd)
                functions[key] = _load(source, style)
                reply: tuple = ("ok", inspect.iscoroutinefunction(functions[key][0]))
            elif op == "calls":
                reply = _calls(functions, request[1])
            else:
                _, key, call = request
                reply = _call(functions[key], call)
        except BaseException as e:  # noqa: BLE001 - whatever user code does is reported, not fatal here
            from sparserl.errors import UserError

            reply = (
                "error" if op == "load" else "raised",
                str(e) if isinstance(e, UserError) else describe(e),
            )
        send(out, reply)


if __name__ == "__main__":
    main()
