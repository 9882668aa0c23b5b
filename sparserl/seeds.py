"""Seeds and prompt order: every random stream of a run derives from the run's seed and a purpose, and the
prompt order is a fresh seeded permutation of the rows per epoch, addressed by one position counter, so the
data position is one integer in the checkpoint and resuming replays the same prompts."""

from __future__ import annotations

import numpy as np

# Seed "purposes": the rollout's sampling, the mini-batch order and evaluation draw independent streams.
ROLLOUT, SHUFFLE, EVAL = 1, 2, 3


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


def _hashed(parts: tuple[int, ...]) -> np.random.SeedSequence:
    return np.random.SeedSequence([abs(int(p)) for p in parts])


def derive_seed(*parts: int) -> int:
    """A 31-bit seed from integers (run seed, step, purpose...), stable across runs and platforms."""
    return int(_hashed(parts).generate_state(1)[0] & 0x7FFFFFFF)


def derive_key(*parts: int) -> int:
    """A 62-bit stream key from integers, the same hash as `derive_seed`'s: wide enough that keys drawn for
    thousands of samples (a tree's children) do not collide."""
    return int(_hashed(parts).generate_state(1, np.uint64)[0]) >> 2
