"""The rollout layer, between the engine and the trainer: which groups run (group sources), what runs them
(backends, returning plain segments), which sequences decode when (scheduler), their records (per-token
provenance), asynchronous rewards and APRIL partial rollouts (layer)."""

from sparserl.rollout.backend import (
    BACKENDS,
    LocalBackend,
    Recording,
    RolloutBackend,
    Segment,
    StaleWeights,
    make_backend,
    register_backend,
)
from sparserl.rollout.layer import Collected, RolloutLayer, RolloutState
from sparserl.rollout.records import GroupRecord, SampleRecord
from sparserl.rollout.scheduler import Scheduler, SchedulerStats
from sparserl.rollout.sources import (
    GROUP_SOURCES,
    FreshPrompts,
    GroupPlan,
    GroupSource,
    LeftoverBuffer,
    SourceContext,
    make_group_source,
    register_group_source,
    step_seed,
)
from sparserl.rollout.task_view import TaskView

__all__ = [
    "BACKENDS",
    "GROUP_SOURCES",
    "Collected",
    "FreshPrompts",
    "GroupPlan",
    "GroupRecord",
    "GroupSource",
    "LeftoverBuffer",
    "LocalBackend",
    "Recording",
    "RolloutBackend",
    "RolloutLayer",
    "RolloutState",
    "SampleRecord",
    "Scheduler",
    "SchedulerStats",
    "Segment",
    "SourceContext",
    "StaleWeights",
    "TaskView",
    "make_backend",
    "make_group_source",
    "register_backend",
    "register_group_source",
    "step_seed",
]
