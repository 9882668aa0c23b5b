"""The rollout layer, between the engine and the trainer: which groups run (group sources), what runs them
(backends, returning plain segments), which sequences decode when (scheduler), their records (per-token
provenance), asynchronous rewards and APRIL partial rollouts (layer), and the sources that choose prompts and
group sizes by their rewards (DARS, VCRL, DAPO's dynamic sampling)."""

from sparserl.rollout import ray_backend as _ray_backend  # noqa: F401 - registers 'ray' (imports Ray only when built)
from sparserl.rollout.backend import (
    BACKENDS,
    LocalBackend,
    RolloutBackend,
    Segment,
    StaleWeights,
    check_backend,
    make_backend,
    register_backend,
)
from sparserl.rollout.layer import Collected, RolloutLayer, RolloutState
from sparserl.rollout.records import GroupRecord, Recording, SampleRecord
from sparserl.rollout.sampling import Dars, DynamicSampling, Vcrl, check_group_sources, make_group_source
from sparserl.rollout.scheduler import Scheduler, SchedulerStats
from sparserl.rollout.sources import (
    GROUP_SOURCES,
    WRAPPERS,
    FreshPrompts,
    GroupPlan,
    GroupSource,
    LeftoverBuffer,
    SourceContext,
    WrappedSource,
    register_group_source,
    register_wrapper,
    step_seed,
)
from sparserl.rollout.task_view import TaskView

__all__ = [
    "BACKENDS",
    "GROUP_SOURCES",
    "Collected",
    "Dars",
    "DynamicSampling",
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
    "Vcrl",
    "WRAPPERS",
    "WrappedSource",
    "check_backend",
    "check_group_sources",
    "make_backend",
    "make_group_source",
    "register_backend",
    "register_group_source",
    "register_wrapper",
    "step_seed",
]
