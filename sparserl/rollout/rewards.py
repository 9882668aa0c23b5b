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

from sparserl.tasks.reward_styles import RewardLogs
from sparserl.tasks.rewards import MAX_ABS_REWARD, usable_reward

logger = logging.getLogger(__name__)
_SAID: set[str] = set()  # what task_rewards has said once on the console


class Rewards(list):
    """One reward per completion (a list of floats) and what the reward functions logged while scoring them
    (`logs`, tasks.reward_styles.RewardLogs): it travels with the rewards from wherever they were scored."""

    def __init__(self, values: Any = (), logs: RewardLogs | None = None) -> None:
        super().__init__(values)
        self.logs = logs if logs is not None else RewardLogs()

    @classmethod
    def of(cls, values: Any) -> Rewards:
        """`values` as Rewards (a plain list logged nothing)."""
        return values if isinstance(values, Rewards) else cls(values)

    def split(self, sizes: list[int]) -> list[Rewards]:
        """Consecutive parts of `sizes` completions, each with its rows of the logged columns; the logged
        metrics go with the first part (they are the whole batch's)."""
        parts, at = [], 0
        for i, n in enumerate(sizes):
            extras = {name: values[at : at + n] for name, values in self.logs.extras.items()}
            metrics = self.logs.metrics if i == 0 else {}
            parts.append(Rewards(self[at : at + n], RewardLogs(metrics, extras)))
            at += n
        return parts


def task_scores(
    task: Any,
    texts: list[str],
    examples: list[Any],
    counters: dict[str, float],
    completion_ids: list[list[int]] | None = None,
    step: int = 0,
) -> Rewards:
    """One reward per completion, scored as one batch (users' TRL-style reward functions see all of it, with
    the completions' token ids and `step`, the updates done, where the task takes them: `score_logged`); a
    reward that raises, overruns, is not finite or lies beyond +-MAX_ABS_REWARD (e.g. a sane reward times a
    huge task.reward_weights) scores 0 and is counted. An object with only `reward(text, example)` (not a
    `Task`) is called per completion under the same rule (errors counted in `counters["reward/errors"]`).
    The rewards are float32 values, as the trainer's tensors hold them."""
    logs = None
    if hasattr(task, "score_logged"):
        scores, logs = task.score_logged(texts, examples, completion_ids, step)
    elif hasattr(task, "score_batch"):
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
    kept = torch.tensor([s if usable_reward(s) else 0.0 for s in scores], dtype=torch.float32)
    return Rewards(kept.tolist(), logs)


def task_rewards(task: Any, texts: list[str], examples: list[Any], counters: dict[str, float]) -> Tensor:
    """`task_scores` as a float32 tensor (what the functions logged is dropped)."""
    return torch.tensor(task_scores(task, texts, examples, counters), dtype=torch.float32)


class RewardWorker:
    """`submit(key, score, texts, examples, completion_ids)` scores one group (`score` returns its rewards, a
    list of floats or `Rewards`): at once on a worker thread when `asynchronous`; else all groups of the step
    in one call at `wait()` (a TRL-style reward function then sees the whole batch). `wait()` returns every
    result by key, as `Rewards`."""

    def __init__(self, asynchronous: bool = True):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewards") if asynchronous else None
        self.pending: dict[Any, Future] = {}
        self.batch: list[tuple[Any, Callable, list[str], list[Any], list[list[int]] | None]] = []

    def submit(
        self,
        key: Any,
        score: Callable[..., list[float]],
        texts: list[str],
        examples: list[Any],
        completion_ids: list[list[int]] | None = None,
    ) -> None:
        """Score a group: `score(texts, examples, completion_ids)` (the ids left out when None)."""
        if self.pool is not None:
            args = (texts, examples) if completion_ids is None else (texts, examples, completion_ids)
            self.pending[key] = self.pool.submit(score, *args)
        else:
            self.batch.append((key, score, texts, examples, completion_ids))

    def wait(self) -> dict[Any, Rewards]:
        """Every submitted group's rewards (a reward function's exception is raised here)."""
        out = {k: Rewards.of(f.result()) for k, f in self.pending.items()}
        if self.batch:
            score = self.batch[0][1]
            texts = [t for b in self.batch for t in b[2]]
            examples = [e for b in self.batch for e in b[3]]
            ids = None if any(b[4] is None for b in self.batch) else [i for b in self.batch for i in b[4]]
            args = (texts, examples) if ids is None else (texts, examples, ids)
            parts = Rewards.of(score(*args)).split([len(b[2]) for b in self.batch])
            out.update({b[0]: part for b, part in zip(self.batch, parts, strict=True)})
        self.pending, self.batch = {}, []
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
