"""The task interface: an `Example` is one prompt with its reference answer; a `Task` is a sequence of them
plus the reward of a completion. Tasks are registered by name so configs can pick them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sparserl.tasks.config import TaskConfig


@dataclass
class Example:
    """One prompt: chat `messages` ending with the \\boxed{} instruction, the reference `answer`, and `meta`
    (provenance such as source file and line, or the generator's parameters)."""

    messages: list[dict]
    answer: str
    meta: dict = field(default_factory=dict)


class Task:
    """A sequence of examples and the reward of a completion. Subclasses implement `__len__`, `__getitem__`
    and `reward`; `score` wraps `reward` so that errors and hangs score 0 and are counted."""

    name: str = "task"

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> Example:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Example]:
        return (self[i] for i in range(len(self)))

    def reward(self, completion_text: str, example: Example) -> float:
        """Reward of one completion, in [0, 1]."""
        raise NotImplementedError


TaskFactory = Callable[[TaskConfig, str], Task]
TASKS: dict[str, TaskFactory] = {}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Register a task factory `(cfg, split) -> Task` under `name`, so `TaskConfig(name=...)` selects it."""

    def deco(factory: TaskFactory) -> TaskFactory:
        TASKS[name] = factory
        return factory

    return deco


def make_task(cfg: TaskConfig, split: str = "train") -> Task:
    """Build the task `cfg.name` for `split` (overridden by `cfg.split` when set)."""
    import sparserl.tasks.builtin  # noqa: F401  (registers the built-in tasks)

    split = cfg.split or split
    if cfg.name in TASKS:
        return TASKS[cfg.name](cfg, split)
    raise ValueError(f"task.name={cfg.name!r} is unknown; choose one of {', '.join(TASKS)} or a data path")
