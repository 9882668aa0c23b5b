"""What the trainer builds besides its loop's state: its own engine (held-out evaluation and the model-backed
judges; rollouts run on the backend's), the resources a judge may use, and the relay that carries the engines'
notes to the console. None of them holds the trainer, so a dropped Trainer is freed (and its run directory's
lock released) at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from sparserl.engine.rollout import RolloutEngine


class Relay:
    """Passes messages on to `to` once it is set (the progress display while the run trains), else drops them:
    what the engines say (a decode step compiling) reaches the console."""

    def __init__(self) -> None:
        self.to: Callable[[str], None] | None = None

    def __call__(self, message: str) -> None:
        if self.to is not None:
            self.to(message)


class OwnEngine:
    """The trainer's own engine over the policy, with the run's engine settings, built at the first call: a run
    that neither evaluates nor asks a judge builds none."""

    def __init__(
        self, model: nn.Module, tokenizer: Any, settings: dict[str, Any], notify: Callable[[str], None]
    ) -> None:
        self.model, self.tokenizer, self.settings, self.notify = model, tokenizer, settings, notify
        self.engine: RolloutEngine | None = None

    def __call__(self) -> RolloutEngine:
        if self.engine is None:
            self.engine = RolloutEngine(self.model, self.tokenizer, **self.settings)
            self.engine.notify = self.notify
        return self.engine


class JudgeResources:
    """What a model-backed advantage transform (a uniqueness judge) may use: the policy's module, its tokenizer
    and autocast context, and the trainer's own engine (built when a judge first asks for it)."""

    def __init__(self, policy: Any, engine: OwnEngine) -> None:
        self.module, self.tokenizer, self.autocast = policy.module, policy.tokenizer, policy.autocast
        self._engine = engine

    @property
    def engine(self) -> RolloutEngine:
        return self._engine()
