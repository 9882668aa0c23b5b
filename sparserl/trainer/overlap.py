"""Which weights draw each step's rollout, and when (`rollout.overlap`).

In step (the default): step t's rollout is drawn by policy t-1, the weights the learner has just made, and the
backend gets each new version as soon as the update ends. Overlapped (one-step off-policy): while step t
updates, step t+1's rollout is drawn on a thread of its own by policy t-1, held in a replica the learner never
writes; the replica (and a remote backend) receives the learner's weights once per version, between the two
threads' work, so no copy of the model is made per step. The learner recomputes pi_old at its own version, so
the corrections see the sampler's staleness and its sparse cache as one mismatch.

A checkpoint taken while a rollout is in flight keeps what that rollout started from (the group source's and
the layer's states, the replica's weights and version): a resume draws it again, the same tokens, instead of
saving it half done.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from sparserl.distributed.weights import load_named, trainable_state
from sparserl.engine.weights import bump_weights_version, drop_packed
from sparserl.trainer.checkpoint import Part

SAMPLER_PART = "sampler"  # checkpoint part: the replica's weights and version, while overlapping


@dataclass
class Ahead:
    """A rollout in flight: the step it is for, the policy version drawing it, and what it started from."""

    step: int
    drawn_by: int
    future: Future
    started_from: dict[str, Any]


class StepRollouts:
    """`take(step, states)` -> the step's rollout (each token records its version). `draw(step, version)` runs
    the rollout layer with the weights the backend holds; `backend.push_weights` hands it a version (with the
    sampler's trainable tensors when it samples from copies); `learner` is the module the learner updates and
    `replica` the sampler's own (None: the backend samples from the learner's, in step); `beside(rollout)` runs
    on the sampler's thread after a rollout drawn ahead (work that does not wait for the update)."""

    def __init__(
        self,
        draw: Callable[[int, int], Any],
        backend: Any,
        learner: torch.nn.Module,
        replica: torch.nn.Module | None,
        last_step: int,
        max_staleness: int = 1,
        beside: Callable[[Any], None] | None = None,
    ) -> None:
        self.draw, self.backend, self.learner, self.replica = draw, backend, learner, replica
        self.last_step, self.max_staleness = last_step, max_staleness
        # what the sampler's thread adds to a rollout it drew ahead (its reference log-probs)
        self.beside = beside
        self.held = 0  # the policy version the sampler holds
        self.ahead: Ahead | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if replica is not None else None

    @property
    def overlapped(self) -> bool:
        return self.pool is not None

    def updated(self, version: int) -> None:
        """The learner made policy `version`. In step, the backend gets it now; overlapped, at the next `take`,
        once the sampler is idle."""
        if not self.overlapped:
            self.push(version)

    def take(self, step: int, states: Callable[[], dict[str, Any]]) -> Any:
        """Step `step`'s rollout: the one drawn ahead (its exception raised here), else drawn now; overlapped,
        the next step's is started before returning (`states()`: what it starts from, for a checkpoint)."""
        version = step - 1  # the learner's version: the policy that trains on this rollout
        got = None
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            got = ahead.future.result()
            if (
                ahead.step != step or version - ahead.drawn_by > self.max_staleness
            ):  # never trained: drawn again
                got = None
        if got is None:
            if version - self.held > self.max_staleness:  # the sampler lags too far: catch it up first
                self._refresh(version)
            got = self.draw(step, self.held)
        # the learner's packed copy (in step, the rollout's; overlapped, the held-out evaluation's): scoring and
        # the update never read it, and the update makes it stale
        drop_packed(self.learner)
        if self.overlapped and step < self.last_step:
            self._refresh(version)
            self.ahead = Ahead(
                step + 1, version, self.pool.submit(self._draw_ahead, step + 1, version), states()
            )
        return got

    def _draw_ahead(self, step: int, version: int) -> Any:
        """On the sampler's thread: the rollout, then what `beside` adds to it while the learner updates. The
        replica's packed copy of its weights is freed in between: the next rollout draws newer weights, and it
        would otherwise sit through the update."""
        got = self.draw(step, version)
        drop_packed(self.replica)
        if self.beside is not None:
            self.beside(got)
        return got

    def _refresh(self, version: int) -> None:
        """The replica (and the backend) take the learner's weights of `version`."""
        if version == self.held:
            return
        self._load_replica(trainable_state(self.learner))
        self.push(version)

    def _load_replica(self, state: dict[str, torch.Tensor]) -> None:
        load_named(self.replica, state)
        bump_weights_version(self.replica)  # the engine over it repacks

    def push(self, version: int) -> None:
        """The backend holds policy `version` (the sampler's tensors travel when it samples from copies)."""
        sampler = self.replica if self.overlapped else self.learner
        self.backend.push_weights(version, trainable_state(sampler) if self.backend.copies_weights else None)
        self.held = version

    def checkpoint(self, states: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Part]]:
        """What a checkpoint keeps: the states a rollout in flight started from (else `states`, today's), and,
        overlapped, the part SAMPLER_PART with the replica's weights and version."""
        if not self.overlapped:
            return states, {}
        started = self.ahead.started_from if self.ahead is not None else states
        return started, {
            SAMPLER_PART: Part(weights=trainable_state(self.replica), state={"version": self.held})
        }

    def resume(self, part: Any, version: int) -> None:
        """After a checkpoint's weights are loaded: overlapped, the replica takes the weights the sampler held
        (the SAMPLER_PART `part`; without one, the learner's) and its version; then the backend is told."""
        if self.overlapped:
            saved = part is not None and part.weights
            self._load_replica(part.weights if saved else trainable_state(self.learner))
            version = int(part.state["version"]) if saved else version
        self.push(version)

    def close(self) -> None:
        """Wait for a rollout in flight (its result is dropped) and stop the thread."""
        if self.ahead is not None:
            self.ahead.future.exception()
            self.ahead = None
        if self.pool is not None:
            self.pool.shutdown(wait=True)
