"""Rewards of finished groups, computed while decoding goes on.

The math-verify checks already run in their own worker process (tasks/rewards.py), so a single thread that
submits a group and waits on that process is enough to overlap scoring with decoding without taking a core
from it; a user's pure-Python reward function shares the interpreter with the decode loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from sparserl.tasks.rewards import MAX_ABS_REWARD, usable_reward

logger = logging.getLogger(__name__)
_SAID: set[str] = set()  # what task_rewards has said once on the console


def task_rewards(task: Any, texts: list[str], examples: list[Any], counters: dict[str, float]) -> Tensor:
    """One reward per completion, scored as one batch (users' TRL-style reward functions see all of it); a
    reward that raises, overruns, is not finite or lies beyond +-MAX_ABS_REWARD (e.g. a sane reward times a
    huge task.reward_weights) scores 0 and is counted. An object with only `reward(text, example)` (not a
    `Task`) is called per completion under the same rule (errors counted in `counters["reward/errors"]`)."""
    if hasattr(task, "score_batch"):
        scores = task.score_batch(texts, examples)
    else:
        scores = []
        for text, ex in zip(texts, examples, strict=True):
            try:
                scores.append(float(task.reward(text, ex)))
            except Exception:  # noqa: BLE001 - a broken reward must not stop training
                scores.append(0.0)
                counters["reward/errors"] = counters.get("reward/errors", 0) + 1
    bad = [s for s in scores if not usable_reward(s)]
    if bad:
        counters["reward/errors"] = counters.get("reward/errors", 0) + len(bad)
        name = getattr(task, "name", type(task).__name__)
        if name not in _SAID:
            _SAID.add(name)
            logger.warning(
                "task %s: a completion's reward is %g, not a finite number within +-%g (check "
                "task.reward_weights): such rewards score 0 (counted in reward/errors; said once)",
                name,
                bad[0],
                MAX_ABS_REWARD,
            )
    return torch.tensor([s if usable_reward(s) else 0.0 for s in scores], dtype=torch.float32)


class RewardWorker:
    """`submit(key, score, texts, examples)` scores one group (`score` returns a list of floats): at once on a
    worker thread when `asynchronous`; else all groups of the step in one call at `wait()` (a TRL-style reward
    function then sees the whole batch). `wait()` returns every result by key."""

    def __init__(self, asynchronous: bool = True):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards") if asynchronous else None
        self.pending: dict[Any, Future] = {}
        self.batch: list[tuple[Any, Callable, list[str], list[Any]]] = []

    def submit(
        self,
        key: Any,
        score: Callable[[list[str], list[Any]], list[float]],
        texts: list[str],
        examples: list[Any],
    ) -> None:
        if self.pool is not None:
            self.pending[key] = self.pool.submit(score, texts, examples)
        else:
            self.batch.append((key, score, texts, examples))

    def wait(self) -> dict[Any, list[float]]:
        """Every submitted group's rewards (a reward function's exception is raised here)."""
        out = {k: f.result() for k, f in self.pending.items()}
        if self.batch:
            score = self.batch[0][1]
            scores = list(score([t for b in self.batch for t in b[2]], [e for b in self.batch for e in b[3]]))
            for key, _, texts, _ in self.batch:
                out[key], scores = scores[: len(texts)], scores[len(texts) :]
        self.pending, self.batch = {}, []
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
