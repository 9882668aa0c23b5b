"""Users' own reward functions, called the way TRL's GRPOTrainer calls its `reward_funcs` (or verl's
`compute_score`: reward_styles).

A reward function scores a batch of completions at once:

    def my_reward(completions: list[str], prompts: list[list[dict]], **kwargs) -> list[float | None]

`completions` are the decoded completion texts (message lists for a conversational dataset), `prompts` the
chat messages they answer, `completion_ids` their tokens, `trainer_state.global_step` the updates done, and
every field of the examples' data rows comes as a keyword argument holding one value per completion (a row
without the field gives None; TRL's reserved 'prompt' and 'completion' columns are left out). Generated tasks
(arithmetic, long_arithmetic) pass `answer` and their problem parameters. A function gets the keywords it
names, or all with `**kwargs`; `log_metric(name, value)` and `log_extra(name, values)` log from inside it (the
logs come back with the rewards). An `async def` function is awaited. A None reward means "does not apply"
and scores 0, as TRL's NaN-sum does.

Functions are named in `task.reward` as 'module:function' or 'path/to/file.py:function', or given as
callables from Python; 'builtin' stands for the task's own verifiable reward, so a format or length bonus can
be added to correctness. The reward of a completion is the weighted sum over the functions. Each call runs
under `task.reward_timeout` like the built-in rewards: a function that raises, overruns, returns the wrong
number of rewards, or a NaN/inf, a value beyond +-MAX_ABS_REWARD (1e6) or a non-number, scores 0 for the
completions affected, which are counted in `reward/errors` and `reward/timeouts`; training goes on. What a
function did is said once per function and kind of failure.

Isolation: named functions ('module:function', 'file.py:function') and plain module-level functions given
from Python are loaded and called in a worker process (`reward_process`), so that `sys.exit`, `os._exit`, a
signal, a hang or a memory blow-up ends only that worker (restarted on the next call; an ended worker is also
counted in `reward/crashes`). Their module is imported there, not in the trainer, when the task is built: an
import that fails or exits is a UserError naming the spec before training starts. A callable that cannot be
sent to the worker by reference (a lambda, a closure, a function of `__main__` such as a notebook's, a bound
method, a callable object) runs in the trainer's process, as it is, with a note said once: an exception,
`sys.exit` or a hang still scores 0, but `os._exit`, a signal or a crash in it ends the run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sparserl.errors import UserError
from sparserl.tasks.base import Example, Task
from sparserl.tasks.config import BUILTIN_REWARD
from sparserl.tasks.reward_calls import (
    Awaited,
    InProcess,
    Isolated,
    NotAReward,
    awaited_together,
    by_reference,
    call_placed,
)
from sparserl.tasks.reward_loading import RewardFn, check_spec
from sparserl.tasks.reward_styles import RewardCall, RewardLogs, RewardState, resolve_style
from sparserl.tasks.rewards import RewardStats, RewardTimeout, finite_reward, record_failure

logger = logging.getLogger(__name__)
_NOTED_IN_PROCESS: set[str] = set()  # in-process reward functions already said (once per process)


# ------------------------------------------------------------------------------------------------- calling


def _reward_count(values: Any) -> int | None:
    """How many rewards `values` holds (a list, tuple, array or tensor), or None when it is not a sequence."""
    if isinstance(values, (str, bytes, dict)):
        return None
    try:
        return len(values)
    except TypeError:
        return None


def _function_name(fn: Any) -> str:
    """How a callable is named in logs and `reward/...` error messages."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class _BadReturn(ValueError):
    """A function returned something that is not one usable reward per completion."""


def _failure_kind(error: BaseException) -> str:
    """What a failure was, for saying each kind once per function: 'timeout', 'sys.exit(3)', 'ValueError'."""
    from sparserl.tasks.reward_process import RewardCrash, RewardRaised

    if isinstance(error, RewardTimeout):
        return "timeout"
    if isinstance(error, _BadReturn):
        return "bad return"
    if isinstance(error, RewardCrash):
        return str(error)
    if isinstance(error, RewardRaised):
        return str(error).split(":", 1)[0]
    if isinstance(error, SystemExit):
        return f"sys.exit({error.code!r})"
    return type(error).__name__


def _what_it_did(error: BaseException, timeout: float | None) -> str:
    """The console's words for a failure: 'called sys.exit(3)', 'overran its 5s limit (task.reward_timeout)'."""
    from sparserl.tasks.reward_process import RewardCrash, RewardRaised

    if isinstance(error, RewardTimeout):
        limit = f"its {timeout:g}s limit" if timeout is not None else "its time limit"
        return f"overran {limit} (task.reward_timeout)"
    if isinstance(error, (RewardCrash, RewardRaised, _BadReturn)):
        return str(error)
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    return f"raised {type(error).__name__}: {error}"


class RewardFnTask(Task):
    """`task`'s prompts, rewarded by the weighted sum of reward functions (see the module docstring). Counts
    failures in the wrapped task's `stats`, so the trainer's reward/errors and reward/timeouts cover the
    built-in reward and the user's functions alike."""

    self_guarded = True

    def __init__(
        self,
        task: Task,
        rewards: Sequence[RewardFn | str],
        weights: Sequence[float] = (),
        timeout: float | None = None,
        style: str = "auto",
    ) -> None:
        if not rewards:
            raise UserError("no reward functions given")
        if weights and len(weights) != len(rewards):
            raise UserError(f"{len(weights)} reward weights for {len(rewards)} reward functions")
        self.task = task
        self.name = task.name
        self.reward_timeout = timeout if timeout is not None else task.reward_timeout
        self.names = [r if isinstance(r, str) else _function_name(r) for r in rewards]
        self.weights = [float(w) for w in weights] if weights else [1.0] * len(rewards)
        self.style = style  # task.reward_style: 'auto', 'trl' or 'verl'
        self.max_steps = 0  # trainer.steps, for `trainer_state.max_steps` (set by the trainer)
        self._process: Any = None  # reward_process.RewardProcess, started for the first isolated function
        self._said: set[tuple[str, str]] = set()
        try:
            self.rewards = [self._prepare(r, i) for i, r in enumerate(rewards)]
        except BaseException:
            self.close()
            raise

    def _prepare(self, reward: RewardFn | str, index: int) -> Any:
        """`reward` as called: BUILTIN_REWARD, an `Isolated` handle in the worker, or `InProcess`."""
        if isinstance(reward, str) and reward == BUILTIN_REWARD:
            return reward
        if not isinstance(reward, str) and not callable(reward):
            raise UserError(f"reward function {reward!r} is not callable")
        source = reward if isinstance(reward, str) else by_reference(reward)
        if isinstance(source, str) and not isinstance(reward, str):
            return self._in_process(reward, source)
        if isinstance(reward, str):
            check_spec(reward)
        if self._process is None:
            from sparserl.tasks.reward_process import RewardProcess

            self._process = RewardProcess()
        key = f"{index}:{self.names[index]}"
        location = reward.rpartition(":")[0] if isinstance(reward, str) else self.names[index]
        failure = self._process.load(key, source, self.style, what=f"importing {location}")
        if failure is None:
            return Isolated(key, key in self._process.asynchronous)
        if isinstance(reward, str):
            raise UserError(
                failure if failure.startswith("task.reward=") else f"task.reward={reward!r}: {failure}"
            )
        return self._in_process(reward, f"the worker could not load it ({failure})")

    def _in_process(self, fn: RewardFn, why: str) -> InProcess:
        """`fn`, called in the trainer's process; says so once per function name."""
        name = _function_name(fn)
        style = resolve_style(fn, self.style, name)
        if name not in _NOTED_IN_PROCESS:
            _NOTED_IN_PROCESS.add(name)
            logger.warning(
                "reward function %s runs in the trainer's process, not isolated in a worker: %s. An exception, "
                "sys.exit or a hang in it scores 0, but os._exit, a signal or a crash ends the run; define it "
                "at the top level of an importable module to isolate it.",
                name,
                why,
            )
        return InProcess(fn, style)

    def close(self) -> None:
        """Stop the reward worker, if any (a later call starts it again)."""
        if self._process is not None:
            self._process.close()

    def start(self) -> None:
        """Start the reward worker and load the functions now (a copy of this task in another process: a
        rollout worker checks there that they import)."""
        if self._process is not None:
            self._process.start()

    @property
    def stats(self) -> RewardStats:
        """The wrapped task's failure counters, shared with its built-in reward."""
        return self.task.stats

    def __len__(self) -> int:
        return len(self.task)

    def __getitem__(self, i: int) -> Example:
        return self.task[i]

    def warmup(self) -> None:
        """The wrapped task's warmup (e.g. the math-verify worker of the built-in reward)."""
        self.task.warmup()

    def reward(self, completion_text: str, example: Example) -> float:
        """The weighted reward of one completion (already guarded: failures score 0 and are counted)."""
        return self.score_batch([completion_text], [example])[0]

    def score(self, completion_text: str, example: Example) -> float:
        """Same as `reward`: every function call is guarded."""
        return self.reward(completion_text, example)

    def score_batch(self, completions: list[str], examples: list[Example]) -> list[float]:
        """Weighted sum of each function's rewards; one call per function for the whole batch."""
        return self.score_logged(completions, examples)[0]

    def score_logged(
        self,
        completions: list[str],
        examples: list[Example],
        completion_ids: list[list[int]] | None = None,
        step: int = 0,
    ) -> tuple[list[float], RewardLogs]:
        """`score_batch` with the completions' token ids and the optimizer updates done so far (TRL's
        `completion_ids` and `trainer_state.global_step`); also returns what the functions logged."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        call = RewardCall.build(completions, examples, completion_ids, RewardState(step, self.max_steps))
        total, logs = [0.0] * len(completions), RewardLogs()
        awaited = awaited_together(self.rewards, call, self._process, self.reward_timeout)
        for fn, name, weight in zip(self.rewards, self.names, self.weights, strict=True):
            if isinstance(fn, str):  # BUILTIN_REWARD
                scores = self.task.score_batch(completions, examples)
            else:
                scores, logged = self._guarded_scores(fn, name, call, awaited.get(id(fn)))
                logs.update(self._checked(logged, len(call), name))
            total = [t + weight * s for t, s in zip(total, scores, strict=True)]
        return total, logs

    def _guarded_scores(
        self,
        fn: Isolated | InProcess,
        name: str,
        call: RewardCall,
        awaited: Awaited | None = None,
    ) -> tuple[list[float], RewardLogs]:
        """`fn`'s reward of each completion, 0 for those it fails on (counted), and what it logged (`awaited`:
        its result already awaited with the others). A batch call that raises (or calls sys.exit) is retried
        one completion at a time, so only the completions it raises on score 0; an overrun or an ended worker
        is not retried (it would cost as much again per completion), nor a wrong number of rewards (a bug)."""
        from sparserl.tasks.reward_process import RewardCrash

        n = len(call)
        try:
            values, logs = (
                awaited()
                if awaited is not None
                else call_placed(fn, call, self._process, self.reward_timeout)
            )
        except (RewardTimeout, RewardCrash) as e:
            return self._failed(e, n, name), RewardLogs()
        except (Exception, SystemExit) as e:
            if n > 1:
                parts = [self._guarded_scores(fn, name, call.subset(i)) for i in range(n)]
                logs = RewardLogs.concat([(1, logged) for _, logged in parts])
                return [s for scores, _ in parts for s in scores], logs
            return self._failed(e, n, name), RewardLogs()
        count = None if isinstance(values, NotAReward) else _reward_count(values)
        if count != n:
            if isinstance(values, NotAReward):
                got = str(values)
            else:
                got = f"a {type(values).__name__}" if count is None else f"{count} rewards"
            return self._failed(_BadReturn(f"returned {got} for {n} completions"), n, name), logs
        self.stats.calls += n
        return [self._one_value(v, name) for v in values], logs

    def _checked(self, logs: RewardLogs, n: int, name: str) -> RewardLogs:
        """`logs` without the log_extra columns that do not hold one value per completion (said once)."""
        for column, values in list(logs.extras.items()):
            if len(values) != n:
                del logs.extras[column]
                self._say(
                    name,
                    f"log_extra {column}",
                    "reward function %s logged %d values of column %r for %d completions: the column is "
                    "dropped (said once)",
                    name,
                    len(values),
                    column,
                    n,
                )
        return logs

    def _failed(self, error: BaseException, n: int, name: str) -> list[float]:
        """Zeros for `n` completions a call of function `name` failed on, counted in the stats."""
        self.stats.calls += n
        self._record(error, n, name)
        return [0.0] * n

    def _record(self, error: BaseException, n: int, name: str) -> None:
        """Count a failure of `n` completions and say what function `name` did, once per kind."""
        from sparserl.tasks.reward_process import RewardCrash

        record_failure(self.stats, error, n, source=f"reward function {name}", log=False)
        if isinstance(error, RewardCrash):
            self.stats.crashes += n
        counter = "timeouts" if isinstance(error, RewardTimeout) else "errors"
        self._say(
            name,
            _failure_kind(error),
            "reward function %s %s: its completions score 0 (counted in reward/%s; said once)",
            name,
            _what_it_did(error, self.reward_timeout),
            counter,
        )

    def _say(self, name: str, kind: str, message: str, *args: Any) -> None:
        """Warn `message % args` once per function `name` and `kind` of event."""
        if (name, kind) not in self._said:
            self._said.add((name, kind))
            logger.warning(message, *args)

    def _one_value(self, value: Any, name: str) -> float:
        """A returned reward as a float: None (does not apply) is 0; NaN, inf, beyond +-MAX_ABS_REWARD or a
        non-number is 0, counted."""
        if value is None:
            return 0.0
        if isinstance(value, NotAReward):
            self._record(_BadReturn(f"returned an item that is not a number ({value})"), 1, name)
            return 0.0
        try:
            return finite_reward(value)
        except (TypeError, ValueError, OverflowError) as e:
            self._record(_BadReturn(f"returned {str(value)[:40]!r}, not a usable reward ({e})"), 1, name)
            return 0.0


def with_reward_fns(
    task: Task,
    rewards: RewardFn | str | Sequence[RewardFn | str],
    weights: Sequence[float] = (),
    timeout: float | None = None,
    style: str = "auto",
) -> RewardFnTask:
    """`task` rewarded by `rewards` (one or several callables, 'module:function' specs or 'builtin'),
    weighted by `weights` (default 1.0 each), each call bounded by `timeout` seconds (default: the task's
    reward_timeout), called in `style` (task.reward_style; reward_styles). Specs are imported now, so a bad one
    fails before training starts."""
    if callable(rewards) or isinstance(rewards, str):
        rewards = [rewards]
    return RewardFnTask(task, list(rewards), weights, timeout, style)
