"""How a user's reward function is called: TRL's `reward_funcs` convention or verl's `compute_score`.

TRL style (`task.reward_style=trl`): one call per batch, `fn(prompts=..., completions=..., completion_ids=...,
trainer_state=..., log_metric=..., log_extra=..., **row_columns)` returning one reward per completion. A function
gets only the keywords it names, or all of them with `**kwargs`. For a conversational dataset (as TRL decides
it: the row's `prompt` is a list of {role, content} messages) each completion is the list of messages
`[{"role": "assistant", "content": text}]`; `prompts` are always the chat messages the model answered.

verl style (`task.reward_style=verl`): one call per completion, `fn(data_source=..., solution_str=...,
ground_truth=..., extra_info=...)` returning a number or a dict with a `score` key (its other keys are logged
like `log_metric` and `log_extra`). `auto` (the default) takes a function naming `solution_str` and
`ground_truth` but not `completions` for verl's, any other for TRL's.

An `async def` function is awaited (verl's: every completion's call at once; several async functions of a task
together, `invoke_together`). `invoke` runs where the function runs, in the reward worker process or, for a
callable that cannot be sent there, in the trainer's process; what it logged comes back with the rewards as
`RewardLogs`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from sparserl.errors import UserError
from sparserl.tasks.config import REWARD_STYLES

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
RESERVED_COLUMNS = ("prompt", "completion")  # as in TRL: the prompt comes as `prompts`
CONVERSATIONAL_KEYS = ("prompt", "messages", "completion")  # TRL's is_conversational, for prompt datasets


@dataclass(frozen=True)
class RewardState:
    """What reward functions see of the trainer as `trainer_state` (TRL passes its TrainerState):
    `global_step`, the optimizer updates done before the batch was sampled, and `max_steps`, trainer.steps
    (0 when the task is used outside a training run)."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class RewardLogs:
    """What reward functions logged in one call: `metrics` (log_metric, and verl's extra dict keys: each
    value as logged; the trainer logs their mean per step) and `extras` (log_extra: a column of one value per
    completion, for the completions table)."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extras: dict[str, list] = field(default_factory=dict)

    def update(self, other: RewardLogs) -> None:
        """Add `other`'s metric values and columns (a column of the same name is replaced)."""
        for name, values in other.metrics.items():
            self.metrics.setdefault(name, []).extend(values)
        self.extras.update(other.extras)

    @classmethod
    def concat(cls, parts: Sequence[tuple[int, RewardLogs]]) -> RewardLogs:
        """The logs of consecutive calls over `n` completions each, as one: metrics pooled, each column
        joined (None for the completions of a call that did not log it)."""
        out = cls()
        names = dict.fromkeys(name for _, logs in parts for name in logs.extras)
        out.extras = {name: [] for name in names}
        for n, logs in parts:
            for name, values in logs.metrics.items():
                out.metrics.setdefault(name, []).extend(values)
            for name in names:
                column = logs.extras.get(name)
                out.extras[name].extend(column if column is not None and len(column) == n else [None] * n)
        return out


def plain(value: Any) -> Any:
    """`value` as a JSON value for the completions table: None, a bool, an int, a finite float or a string
    (anything else as its str; NaN and inf as None)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    try:
        number = float(value)  # numpy and torch scalars
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


def is_conversational(row: dict) -> bool:
    """TRL's rule: a prompt column holding a list of {role, content} messages."""
    for key in CONVERSATIONAL_KEYS:
        value = row.get(key)
        if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
            return True
    return False


def _row_fields(example: Any) -> dict[str, Any]:
    """The fields a reward function sees for `example`: its data row, or for a generated problem the answer
    and the generator's parameters."""
    return example.row or {"answer": example.answer, **example.meta}


@dataclass
class RewardCall:
    """One batch for the reward functions, as sent to the worker: the completion texts, their token ids
    (None where unknown), the prompts' chat messages, each row column as a list aligned with the completions,
    the reference answers, whether the data is conversational, and the trainer's state."""

    completions: list[str]
    prompts: list[list[dict]]
    columns: dict[str, list]
    answers: list[str]
    completion_ids: list[list[int]] | None = None
    conversational: bool = False
    state: RewardState = RewardState()

    @classmethod
    def build(
        cls,
        completions: Sequence[str],
        examples: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
        state: RewardState = RewardState(),
    ) -> RewardCall:
        """The call for `completions` of `examples` (tasks.base.Example), one example per completion."""
        rows = [_row_fields(e) for e in examples]
        keys = dict.fromkeys(k for row in rows for k in row if k not in RESERVED_COLUMNS)
        return cls(
            completions=list(completions),
            prompts=[e.messages for e in examples],
            columns={k: [row.get(k) for row in rows] for k in keys},
            answers=[e.answer for e in examples],
            completion_ids=[list(ids) for ids in completion_ids] if completion_ids is not None else None,
            conversational=bool(examples) and is_conversational(examples[0].row),
            state=state,
        )

    def __len__(self) -> int:
        return len(self.completions)

    def subset(self, i: int) -> RewardCall:
        """The call for completion `i` alone (a batch that raised is retried one completion at a time)."""
        return replace(
            self,
            completions=self.completions[i : i + 1],
            prompts=self.prompts[i : i + 1],
            columns={k: v[i : i + 1] for k, v in self.columns.items()},
            answers=self.answers[i : i + 1],
            completion_ids=self.completion_ids[i : i + 1] if self.completion_ids is not None else None,
        )

    def trl_kwargs(self) -> dict[str, Any]:
        """TRL's keyword arguments, but the two logging callbacks."""
        kwargs: dict[str, Any] = {k: list(v) for k, v in self.columns.items()}
        kwargs["prompts"] = self.prompts
        kwargs["completions"] = (
            [[{"role": "assistant", "content": c}] for c in self.completions]
            if self.conversational
            else list(self.completions)
        )
        if self.completion_ids is not None:
            kwargs["completion_ids"] = self.completion_ids
        kwargs["trainer_state"] = self.state
        return kwargs

    def verl_kwargs(self, i: int) -> dict[str, Any]:
        """verl's keyword arguments for completion `i`: the row's `data_source` and `extra_info`, and its
        `reward_model.ground_truth` (verl's data layout), else the task's reference answer."""
        column = self.columns

        def value(key: str) -> Any:
            return column[key][i] if key in column else None

        model = value("reward_model")
        truth = model.get("ground_truth") if isinstance(model, dict) else None
        return {
            "data_source": value("data_source") or "",
            "solution_str": self.completions[i],
            "ground_truth": truth if truth is not None else self.answers[i],
            "extra_info": value("extra_info") or {},
        }


# ------------------------------------------------------------------------------------------------ styles


def _parameters(fn: Callable) -> tuple[set[str], bool] | None:
    """The keyword names `fn` takes and whether it takes `**kwargs`; None when it has no signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def resolve_style(fn: Callable, style: str, name: str) -> str:
    """'trl' or 'verl' for `fn` under task.reward_style=`style` ('auto' reads the signature); UserError when
    `fn` cannot take verl's arguments under 'verl'."""
    if style not in REWARD_STYLES:
        raise UserError(f"task.reward_style={style!r}: choose one of {', '.join(REWARD_STYLES)}")
    found = _parameters(fn)
    if style == "auto":
        named = found[0] if found is not None else set()
        return "verl" if {"solution_str", "ground_truth"} <= named and "completions" not in named else "trl"
    if style == "verl" and found is not None and not found[1] and not set(VERL_PARAMS[1:3]) <= found[0]:
        raise UserError(
            f"task.reward_style=verl but reward function {name} takes ({', '.join(sorted(found[0]))}), not "
            f"verl's ({', '.join(VERL_PARAMS)})"
        )
    return style


def accepted(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The part of `kwargs` that `fn` accepts: all of it with `**kwargs` (or no signature), else the names it
    lists. `completions_ids`, the name TRL's documentation uses, is given too where `fn` names it."""
    found = _parameters(fn)
    if found is None:
        return kwargs
    named, takes_all = found
    out = dict(kwargs) if takes_all else {k: v for k, v in kwargs.items() if k in named}
    if "completions_ids" in named and "completion_ids" in kwargs:
        out["completions_ids"] = kwargs["completion_ids"]
    return out


def _await(awaitable: Any) -> Any:
    """The result of `awaitable`, run to completion on an event loop of its own (on a thread of its own where
    this thread already runs one, as in a notebook)."""

    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, wait()).result()


def _verl_score(item: Any, i: int, n: int, logs: RewardLogs) -> Any:
    """A verl result's reward: the number, or a dict's `score` (its other keys go to `logs`); a dict
    without `score` is returned as it is, which is no reward (counted as such)."""
    if not isinstance(item, dict) or "score" not in item:
        return item
    for key, value in item.items():
        if key == "score":
            continue
        value = plain(value)
        logs.extras.setdefault(str(key), [None] * n)[i] = value
        if isinstance(value, (int, float)):  # bools too: verl's `acc`
            logs.metrics.setdefault(str(key), []).append(float(value))
    return item["score"]


@dataclass
class _Begun:
    """A function called on a batch: what it returned (an awaitable for an async function), what it logs into,
    and how the returned value becomes its result."""

    value: Any
    logs: RewardLogs
    finish: Callable[[Any], Any]


def _begin(fn: Callable, style: str, call: RewardCall) -> _Begun:
    """Call `fn` on `call` in `style` ('trl' or 'verl'), not awaiting what it returns."""
    logs = RewardLogs()
    if style == "verl":
        results = [fn(**accepted(fn, call.verl_kwargs(i))) for i in range(len(call))]
        value = _gathered(results) if any(inspect.isawaitable(r) for r in results) else results
        return _Begun(value, logs, lambda rs: [_verl_score(r, i, len(call), logs) for i, r in enumerate(rs)])

    def log_metric(name: str, value: float) -> None:
        logs.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(name: str, values: Sequence[Any]) -> None:
        logs.extras.setdefault(str(name), []).extend(plain(v) for v in values)

    kwargs = call.trl_kwargs() | {"log_metric": log_metric, "log_extra": log_extra}
    return _Begun(fn(**accepted(fn, kwargs)), logs, lambda value: value)


async def _gathered(results: list) -> list:
    """verl's per-completion results, the awaitable ones awaited together."""
    return list(await asyncio.gather(*(r if inspect.isawaitable(r) else _done(r) for r in results)))


def invoke(fn: Callable, style: str, call: RewardCall) -> tuple[Any, RewardLogs]:
    """Call `fn` on `call` in `style` ('trl' or 'verl'), awaiting it if it is a coroutine function; returns
    what it returned (verl: one result per completion) and what it logged."""
    begun = _begin(fn, style, call)
    value = _await(begun.value) if inspect.isawaitable(begun.value) else begun.value
    return begun.finish(value), begun.logs


def invoke_together(
    calls: Sequence[tuple[Callable, str, RewardCall]],
) -> list[tuple[Any, RewardLogs] | Exception]:
    """`invoke` for several functions, each result or the exception it raised: the functions are called one
    after another, then what the async ones returned is awaited together on one event loop (TRL gathers its
    async reward functions so). A SystemExit while awaiting ends the whole call (the caller falls back to
    `invoke` one function at a time)."""
    begun: list[_Begun | Exception] = []
    for fn, style, call in calls:
        try:
            begun.append(_begin(fn, style, call))
        except Exception as e:  # noqa: BLE001 - the function's own failure, reported as its result
            begun.append(e)
    waiting = [i for i, b in enumerate(begun) if isinstance(b, _Begun) and inspect.isawaitable(b.value)]

    async def together() -> list:
        return await asyncio.gather(*(begun[i].value for i in waiting), return_exceptions=True)

    values = dict(zip(waiting, _await(together()), strict=True)) if waiting else {}
    out: list[tuple[Any, RewardLogs] | Exception] = []
    for i, b in enumerate(begun):
        value = values.get(i, b.value if isinstance(b, _Begun) else None)
        if isinstance(b, Exception) or isinstance(value, BaseException):
            out.append(b if isinstance(b, Exception) else _as_exception(value))
            continue
        try:
            out.append((b.finish(value), b.logs))
        except Exception as e:  # noqa: BLE001 - e.g. a verl dict without a score, as the function's failure
            out.append(e)
    return out


def _as_exception(error: BaseException) -> Exception:
    """An awaited function's failure as an Exception (asyncio returns a cancellation as a BaseException)."""
    return error if isinstance(error, Exception) else RuntimeError(f"{type(error).__name__}: {error}")


async def _done(value: Any) -> Any:
    """`value` as an awaitable (a verl function that returns at once for some completions)."""
    return value
