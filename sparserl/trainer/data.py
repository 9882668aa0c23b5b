"""Prompt order: a fresh seeded permutation of the task per epoch, addressed by a single position counter,
so the data position is one integer in the checkpoint and resuming replays the same prompts; and which rows
fit the model at all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sparserl.engine.context_length import split_by_fit, too_long_message
from sparserl.errors import DataError


class PromptSampler:
    """Yields task indices: epoch e is permutation(seed, e) of range(n); `position` counts indices drawn."""

    def __init__(self, num_examples: int, seed: int, position: int = 0) -> None:
        if num_examples < 1:
            raise ValueError("the task has no examples to sample prompts from")
        self.n = num_examples
        self.seed = seed
        self.position = position
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm

    def take(self, count: int) -> list[int]:
        """The next `count` indices (crossing into the next epoch's permutation when one runs out)."""
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, self.n)
            out.append(int(self._permutation(epoch)[offset]))
            self.position += 1
        return out


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (run seed, step, purpose...), stable across runs and platforms."""
    return int(np.random.SeedSequence([abs(int(p)) for p in parts]).generate_state(1)[0] & 0x7FFFFFFF)


def usable_rows(
    task: Any,
    prompt_length: Callable[[int], int],
    max_positions: int | None,
    max_new_tokens: int,
    on_long_prompt: str,
    want: int | None = None,
) -> tuple[list[int], str | None]:
    """The rows whose prompt leaves room for `max_new_tokens` in the model's `max_positions`, checked once when
    the data is loaded rather than crashing the run when a long row is drawn; with `want`, only until that many
    fit (evaluation uses its first rows). Rows from data files are checked (their examples say `where` they
    come from; generated tasks are short by construction). Returns the rows and a note naming the skipped ones
    by file:line; with on_long_prompt='error' a row that does not fit is a DataError instead."""
    rows = range(len(task))
    if not max_positions or not rows or not getattr(task[0], "where", ""):
        return list(rows)[:want], None
    keep, long = split_by_fit(rows, prompt_length, max_new_tokens, max_positions, want)
    if not long:
        return keep, None
    what = too_long_message(
        long, lambda i: task[i].where, max_new_tokens, max_positions, "rollout.max_new_tokens"
    )
    if on_long_prompt == "error":
        raise DataError(
            f"{what}; shorten them, lower rollout.max_new_tokens, or set task.on_long_prompt=skip"
        )
    if not keep:
        raise DataError(f"every prompt is too long: {what}")
    return keep, f"[yellow]skipped[/yellow] {what}"
