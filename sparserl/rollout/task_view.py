"""A task as the rollout layer sees it: a row's chat-templated prompt tokens, and the rewards of completions.

One object per task for the whole run (not closures over the trainer), so that a backend worker or a group
source can hold one; the reward counters (errors, timeouts) it gathers are drained by the trainer each step.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from sparserl.rollout.rewards import task_rewards


class TaskView:
    """`prompt_ids(row)` (cached), `decode(token lists)`, `example(row)`, `rewards(texts, examples)`."""

    def __init__(self, task: Any, tokenizer: Any) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.counters: dict[str, float] = {}
        self._prompts: dict[int, list[int]] = {}

    def prompt_ids(self, row: int) -> list[int]:
        from sparserl.models import encode_prompt

        if row not in self._prompts:
            self._prompts[row] = encode_prompt(self.tokenizer, self.task[row].messages)
        return self._prompts[row]

    def example(self, row: int) -> Any:
        return self.task[row]

    def decode(self, completions: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(completions, skip_special_tokens=True)

    def rewards(self, texts: list[str], examples: list[Any]) -> Tensor:
        """One reward per completion (`task_rewards`: a bad reward scores 0 and is counted)."""
        return task_rewards(self.task, texts, examples, self.counters)

    def scores(self, texts: list[str], examples: list[Any]) -> list[float]:
        """`rewards` as plain floats (what a reward worker hands back)."""
        return self.rewards(texts, examples).tolist()

    def start_rewards(self) -> None:
        """Load the task's reward functions now where it has a process of its own for them (a copy sent to a
        rollout worker checks that they import there)."""
        start = getattr(self.task, "start", None)
        if callable(start):
            start()

    def drain_counters(self) -> dict[str, float]:
        """The counters gathered since the last call, the task's own (`task.stats`: reward calls, errors,
        timeouts) included; both are reset."""
        out, self.counters = self.counters, {}
        stats = getattr(self.task, "stats", None)
        if stats is not None and hasattr(stats, "as_metrics"):
            for k, v in stats.as_metrics().items():
                out[k] = out.get(k, 0.0) + float(v)
            if hasattr(stats, "reset"):
                stats.reset()
        return out
