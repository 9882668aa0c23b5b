"""The rollout layer as a training run builds it from its config: the checks made before anything loads, then
the run's backend, built from the config over the policy's modules, under the layer. The trainer's way in, so
that it never names a backend (tests/test_import_graph.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from sparserl.rollout.backend import check_backend, make_backend
from sparserl.rollout.layer import RolloutLayer
from sparserl.rollout.records import Recording
from sparserl.rollout.sampling import check_group_sources
from sparserl.rollout.task_view import TaskView


def check_rollout(cfg: Any) -> None:
    """Refuse, before anything loads, what the run's group sources or its backend do not declare they can do."""
    check_group_sources(cfg)
    check_backend(cfg)


def build_rollout(
    cfg: Any,
    model: nn.Module,
    tokenizer: Any,
    view: TaskView,
    recording: Recording,
    notify: Callable[[str], None] | None = None,
) -> RolloutLayer:
    """The run's backend (`make_backend`) over the policy's `model`, asked to record `recording`, and the layer
    over it, taking prompts and rewards from `view`; `notify` hears what the backend says (a step compiling)."""
    backend = make_backend(cfg, model, tokenizer, recording, notify)
    return RolloutLayer(backend, view, cfg.rollout, cfg.sampling.max_extra_rounds)
