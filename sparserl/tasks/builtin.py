"""Registers the built-in tasks with `make_task`."""

from __future__ import annotations

from sparserl.tasks.arithmetic import ArithmeticTask
from sparserl.tasks.base import register_task
from sparserl.tasks.dataset import make_dataset_task
from sparserl.tasks.long_arithmetic import LongArithmeticTask

register_task("arithmetic")(ArithmeticTask)
register_task("long_arithmetic")(LongArithmeticTask)
register_task("gsm8k")(make_dataset_task)
register_task("math")(make_dataset_task)
