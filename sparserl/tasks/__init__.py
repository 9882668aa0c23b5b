"""Tasks: prompts (chat messages with the \\boxed{} instruction), datasets and verifiable rewards."""

from __future__ import annotations

from sparserl.tasks.base import TASKS, Example, Task, make_task, register_task
from sparserl.tasks.config import BOXED_INSTRUCTION, BUILTIN_TASKS, TaskConfig
from sparserl.tasks.rewards import RewardStats, RewardTimeout

__all__ = [
    "BOXED_INSTRUCTION",
    "BUILTIN_TASKS",
    "TASKS",
    "Example",
    "RewardStats",
    "RewardTimeout",
    "Task",
    "TaskConfig",
    "make_task",
    "register_task",
]
