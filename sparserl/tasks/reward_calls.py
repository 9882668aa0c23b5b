"""Where a user's reward function runs and how it is called: loaded in the task's reward worker process
(`Isolated`) or called in the trainer's (`InProcess`), one function at a time (`call_placed`) or, for async
functions, awaited together with the others that run in the same place (`awaited_together`, as TRL gathers
its async reward functions). Failures come back raised; reward_fns guards and counts them."""

from __future__ import annotations

import functools
import inspect
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sparserl.tasks.reward_loading import RewardFn
from sparserl.tasks.reward_styles import RewardCall, RewardLogs, invoke, invoke_together
from sparserl.tasks.rewards import RewardTimeout, call_with_deadline

# a function's result on a call and its logs, or what it raised, once asked for
Awaited = Callable[[], tuple[Any, RewardLogs]]


def by_reference(fn: Any) -> bytes | str:
    """The pickle of `fn` by reference (module and name), which a worker process can load; else why not."""
    if not inspect.isfunction(fn):
        return f"it is a {type(fn).__name__}, not a plain function"
    module = getattr(fn, "__module__", None)
    if not module or module == "__main__":
        return "it is defined in __main__ (a script or notebook), which a worker cannot import"
    if "<" in fn.__qualname__:  # <lambda>, <locals>
        return "it is a lambda or a local function"
    try:
        return pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - any reason means: keep it in-process
        return f"it cannot be pickled ({type(e).__name__}: {e})"


@dataclass(frozen=True)
class Isolated:
    """A reward function loaded in the task's worker process under `key` (`asynchronous`: an `async def`)."""

    key: str
    asynchronous: bool = False


@dataclass(frozen=True)
class InProcess:
    """A reward function called in the trainer's process, in `style` ('trl' or 'verl')."""

    fn: RewardFn
    style: str


class NotAReward(str):
    """An item of an isolated function's result that is no number (the text says why)."""


def isolated_result(reply: tuple) -> tuple[Any, RewardLogs]:
    """A worker's reply to a call: the function's items (`NotAReward` for those that are no number) or
    `NotAReward` for a result that is no sequence, and its logs; RewardRaised when it raised."""
    from sparserl.tasks.reward_process import RewardRaised

    if reply[0] == "raised":
        raise RewardRaised(reply[1])
    kind, values, logs = reply
    if kind == "count":
        return NotAReward(values), logs
    return [NotAReward(v) if isinstance(v, str) else v for v in values], logs


def call_placed(
    fn: Isolated | InProcess, call: RewardCall, process: Any, timeout: float | None
) -> tuple[Any, RewardLogs]:
    """`fn`'s result on `call` and what it logged, under `timeout`: in the worker `process` for an `Isolated`
    one (its items come back as floats, None or `NotAReward`), else in this process."""
    if isinstance(fn, InProcess):
        return call_with_deadline(functools.partial(invoke, fn.fn, fn.style, call), (), timeout)
    return isolated_result(process.call(fn.key, call, timeout))


def awaited_together(
    functions: Sequence[Isolated | InProcess | str], call: RewardCall, process: Any, timeout: float | None
) -> dict[int, Awaited]:
    """The async functions' results on `call`, awaited together where two or more run in the same place, by
    id of the function: each a callable that returns what `call_placed` would, or raises what it would (an
    overrun or an ended worker: for every one awaited with it). The worker's are awaited together there, the
    in-process ones together here, one group after the other. None for a group of fewer than two, or when
    awaiting it ended in sys.exit (each is then called on its own)."""
    isolated = [fn for fn in functions if isinstance(fn, Isolated) and fn.asynchronous]
    here = [fn for fn in functions if isinstance(fn, InProcess) and _is_async(fn.fn)]
    awaited = _together_in_worker(isolated, call, process, timeout) if len(isolated) > 1 else {}
    return awaited | (_together_here(here, call, timeout) if len(here) > 1 else {})


def _together_in_worker(
    together: list[Isolated], call: RewardCall, process: Any, timeout: float | None
) -> dict[int, Awaited]:
    """`awaited_together` for the worker's async functions (its op 'calls')."""
    from sparserl.tasks.reward_process import RewardCrash, RewardRaised

    try:
        replies = process.call_together([(fn.key, call) for fn in together], timeout)
    except RewardRaised:
        return {}
    except (RewardTimeout, RewardCrash) as e:
        return {id(fn): functools.partial(_reraise, e) for fn in together}
    return {
        id(fn): functools.partial(isolated_result, reply) for fn, reply in zip(together, replies, strict=True)
    }


def _together_here(together: list[InProcess], call: RewardCall, timeout: float | None) -> dict[int, Awaited]:
    """`awaited_together` for the async functions of this process, under one timeout."""
    try:
        results = call_with_deadline(
            invoke_together, ([(fn.fn, fn.style, call) for fn in together],), timeout
        )
    except RewardTimeout as e:
        return {id(fn): functools.partial(_reraise, e) for fn in together}
    except (Exception, SystemExit):  # noqa: BLE001 - sys.exit while awaiting: each is called on its own
        return {}
    return {
        id(fn): functools.partial(_reraise, result) if isinstance(result, Exception) else _returning(result)
        for fn, result in zip(together, results, strict=True)
    }


def _returning(result: tuple[Any, RewardLogs]) -> Awaited:
    """A callable that returns `result` (a function's result already awaited)."""
    return lambda: result


def _is_async(fn: Any) -> bool:
    """Whether calling `fn` returns a coroutine: an `async def` function or method, or an object whose
    `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _reraise(error: BaseException) -> Any:
    """Raise `error` (a failure shared by every function awaited together, or one function's own)."""
    raise error
