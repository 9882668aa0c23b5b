"""`arithmetic`: procedural integer expressions ('What is 37 + 5?') with configurable difficulty.

Problem i of a split is a pure function of (seed, split, i), so the task is deterministic, needs no files
and can be indexed in any order. The easiest setting (2 operands, 1-2 digits, '+') is within reach of
SmolLM2-135M-Instruct, so RL shows reward rising within a few steps; more operands, digits and the '-' and
'*' operators make it harder. The reward accepts only a plain number equal to the value (an unevaluated
expression in the box does not count)."""

from __future__ import annotations

import random

from sparserl.tasks.base import Example, Task
from sparserl.tasks.config import TaskConfig
from sparserl.tasks.prompts import build_messages
from sparserl.tasks.rewards import numeric_reward


def problem_rng(kind: str, seed: int, split: str, index: int) -> random.Random:
    """Independent, reproducible RNG for one problem (string seeds hash with SHA-512, stable across runs)."""
    return random.Random(f"{kind}:{seed}:{split}:{index}")


def draw_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """An integer with a uniformly drawn digit count in [min_digits, max_digits]."""
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of `o0 op0 o1 op1 ...` with '*' binding tighter than '+' and '-'."""
    terms = [operands[0]]
    signs = [1]
    for op, x in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def render(operands: list[int], operators: list[str], names: list[str] | None = None) -> str:
    """'37 + 5 * 2' (or with `names` in place of the numbers)."""
    items = names if names is not None else [str(x) for x in operands]
    parts = [items[0]]
    for op, item in zip(operators, items[1:], strict=True):
        parts += [op, item]
    return " ".join(parts)


class ArithmeticTask(Task):
    """Procedural arithmetic; see the module docstring."""

    name = "arithmetic"
    self_guarded = True

    def __init__(self, cfg: TaskConfig, split: str = "train") -> None:
        self.cfg = cfg
        self.split = split
        self.reward_timeout = cfg.reward_timeout

    def __len__(self) -> int:
        return self.cfg.num_examples

    def _index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.name} has {n} examples (task.num_examples); index {i} is out of range")
        return i % n

    def __getitem__(self, i: int) -> Example:
        i = self._index(i)
        c = self.cfg
        rng = problem_rng(self.name, c.seed, self.split, i)
        operands = [draw_operand(rng, c.min_digits, c.max_digits) for _ in range(c.num_operands)]
        operators = [rng.choice(c.operators) for _ in range(c.num_operands - 1)]
        expression = render(operands, operators)
        value = evaluate(operands, operators)
        messages = build_messages(f"What is {expression}?", c.instruction, c.system_prompt)
        return Example(messages, str(value), {"index": i, "split": self.split, "expression": expression})

    def reward(self, completion_text: str, example: Example) -> float:
        """Correct plain number in the last \\boxed{} (or after ####), mixed with the format reward."""
        return numeric_reward(completion_text, example.answer, self.cfg.format_weight)
