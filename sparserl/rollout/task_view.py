"""A task as the rollout layer sees it: a row's chat-templated prompt tokens, and the rewards of completions.

One object per task for the whole run (not closures over the trainer), so that a backend worker or a group
source can hold one; the reward counters (errors, timeouts) it gathers, and the metrics users' reward functions
log (`log_metric`), are drained by the trainer each step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sparserl.rollout.rewards import Rewards, task_scores

LOGGED_PREFIX = "reward_fn/"  # the step metric of a value a reward function logged with log_metric


class TaskView:
    """`prompt_ids(row)` (cached), `decode(token lists)`, `example(row)`, `rewards(texts, examples)`."""

    takes_completion_ids = True  # `scores` passes the completions' tokens on to the reward functions

    def __init__(self, task: Any, tokenizer: Any) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.counters: dict[str, float] = {}
        self.logged: dict[str, list[float]] = {}  # log_metric values since the last drain_logged
        self.step = 0  # optimizer updates done: trainer_state.global_step of the reward calls (the layer's)
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
        """One reward per completion (`task_scores`: a bad reward scores 0 and is counted); the metrics the
        reward functions logged are kept for `drain_logged` (held-out evaluation)."""
        got = self.scores(texts, examples)
        self.log(got.logs.metrics)
        return torch.tensor(got, dtype=torch.float32)

    def scores(
        self, texts: list[str], examples: list[Any], completion_ids: list[list[int]] | None = None
    ) -> Rewards:
        """The rewards as floats, with what the reward functions logged (what a reward worker hands back).
        A task whose reward functions take the completions' tokens gets `completion_ids`, or the texts
        encoded again where the caller has none."""
        if completion_ids is None and hasattr(self.task, "score_logged"):
            completion_ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return task_scores(self.task, texts, examples, self.counters, completion_ids, self.step)

    def log(self, metrics: dict[str, list[float]]) -> None:
        """Keep values the reward functions logged (`log_metric`) until `drain_logged`."""
        for name, values in metrics.items():
            self.logged.setdefault(name, []).extend(values)

    def drain_logged(self) -> dict[str, float]:
        """The mean of each metric logged since the last call, as `reward_fn/<name>` (TRL averages them over
        a logging step too); reset."""
        out = {f"{LOGGED_PREFIX}{k}": sum(v) / len(v) for k, v in self.logged.items() if v}
        self.logged = {}
        return out

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
