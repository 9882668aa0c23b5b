"""Tasks: prompts (chat messages with the \\boxed{} instruction), datasets, verifiable rewards and users'
own reward functions."""

from __future__ import annotations

from sparserl.tasks.base import Example, Task
from sparserl.tasks.config import BOXED_INSTRUCTION, BUILTIN_REWARD, BUILTIN_TASKS, TaskConfig
from sparserl.tasks.registry import TASKS, make_task, register_task
from sparserl.tasks.reward_fns import RewardFnTask, with_reward_fns
from sparserl.tasks.reward_loading import load_reward_function
from sparserl.tasks.rewards import RewardStats, RewardTimeout

__all__ = [
    "BOXED_INSTRUCTION",
    "BUILTIN_REWARD",
    "BUILTIN_TASKS",
    "TASKS",
    "Example",
    "RewardFnTask",
    "RewardStats",
    "RewardTimeout",
    "Task",
    "TaskConfig",
    "load_reward_function",
    "make_task",
    "register_task",
    "with_reward_fns",
]
