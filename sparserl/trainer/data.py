"""The run's tasks, and which of their rows fit the model at all (checked once when the data is loaded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparserl.engine.context_length import split_by_fit, too_long_message
from sparserl.errors import DataError


def usable_rows(
    task: Any,
    prompt_length: Callable[[int], int],
    max_positions: int | None,
    max_new_tokens: int,
    on_long_prompt: str,
    want: int | None = None,
) -> tuple[list[int], str | None]:
    """The rows whose prompt leaves room for `max_new_tokens` in the model's `max_positions`, checked once when
    the data is loaded rather than crashing the run when a long row is drawn; with `want`, only until that many
    fit (evaluation uses its first rows). Rows from data files are checked (their examples say `where` they
    come from; generated tasks are short by construction). Returns the rows and a note naming the skipped ones
    by file:line; with on_long_prompt='error' a row that does not fit is a DataError instead."""
    rows = range(len(task))
    if not max_positions or not rows or not getattr(task[0], "where", ""):
        return list(rows)[:want], None
    keep, long = split_by_fit(rows, prompt_length, max_new_tokens, max_positions, want)
    if not long:
        return keep, None
    what = too_long_message(
        long, lambda i: task[i].where, max_new_tokens, max_positions, "rollout.max_new_tokens"
    )
    if on_long_prompt == "error":
        raise DataError(
            f"{what}; shorten them, lower rollout.max_new_tokens, or set task.on_long_prompt=skip"
        )
    if not keep:
        raise DataError(f"every prompt is too long: {what}")
    return keep, f"[yellow]skipped[/yellow] {what}"


def training_tasks(cfg: Any, task: Any, eval_task: Any, reward_fn: Any) -> tuple[Any, Any]:
    """The train task and the held-out one (None without held-out prompts): the config's unless given, with
    `reward_fn` (Python reward functions, called in task.reward_style) in place of their rewards when given.
    Reward functions see trainer.steps as `trainer_state.max_steps`."""
    from sparserl.tasks import RewardFnTask, make_task, with_reward_fns

    task = task if task is not None else make_task(cfg.task, "train")
    if eval_task is None and cfg.trainer.eval_prompts > 0:
        eval_task = make_task(cfg.eval_task_config(), "test")
    if reward_fn is not None:
        style = cfg.task.reward_style
        task = with_reward_fns(task, reward_fn, style=style)
        eval_task = with_reward_fns(eval_task, reward_fn, style=style) if eval_task is not None else None
    for t in (task, eval_task):
        if isinstance(t, RewardFnTask):
            t.max_steps = cfg.trainer.steps
    return task, eval_task
