"""Tasks by name: the registry that `TaskConfig(name=...)` picks from (the built-in tasks first, then what
`register_task` adds) and `make_task`, which builds one. Above the task modules: none of them imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sparserl.errors import UserError
from sparserl.registry import Registry
from sparserl.tasks.arithmetic import ArithmeticTask
from sparserl.tasks.base import Task
from sparserl.tasks.config import TaskConfig
from sparserl.tasks.dataset import is_local_source, make_dataset_task
from sparserl.tasks.long_arithmetic import LongArithmeticTask
from sparserl.tasks.reward_fns import with_reward_fns

TaskFactory = Callable[[TaskConfig, str], Task]
TASKS: Registry[Any] = Registry("task.name")  # name -> TaskFactory (a Task class is one)


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Register a task factory `(cfg, split) -> Task` under `name`, so `TaskConfig(name=...)` selects it. Unlike
    `Registry.register` it leaves the factory's `name` alone: one factory may serve several names (gsm8k and
    math), and a Task class keeps its own."""

    def deco(factory: TaskFactory) -> TaskFactory:
        TASKS[name] = factory
        return factory

    return deco


# the built-in tasks, in BUILTIN_TASKS' order (tasks/config.py lists them for the config, which this imports)
register_task("arithmetic")(ArithmeticTask)
register_task("long_arithmetic")(LongArithmeticTask)
register_task("gsm8k")(make_dataset_task)
register_task("math")(make_dataset_task)


def make_task(cfg: TaskConfig, split: str = "train") -> Task:
    """Build the task `cfg.name` for `split` (`cfg.split` wins when set). A name that is not registered is
    a label for the dataset in `cfg.data` or, without it, a local data file or Hugging Face dataset name.
    With `cfg.reward` set, the rewards come from those functions (see `reward_fns.with_reward_fns`)."""
    split = cfg.split or split
    if cfg.name in TASKS:
        task = TASKS.lookup(cfg.name)(cfg, split)
    elif cfg.data or is_local_source(cfg.name) or "/" in cfg.name:
        task = make_dataset_task(cfg, split)
    else:
        raise UserError(
            f"task.name={cfg.name!r} is unknown; choose one of "
            f"{', '.join(sorted(TASKS))}, a .jsonl/.json/.parquet path or a Hugging "
            "Face dataset name"
        )
    if cfg.reward:
        task = with_reward_fns(task, cfg.reward, cfg.reward_weights, cfg.reward_timeout, cfg.reward_style)
    return task
