"""The rollout layer, between the engine and the trainer: which sequences run when (scheduler), their records
(per-token provenance), asynchronous rewards and APRIL partial rollouts (layer)."""

from sparserl.rollout.layer import PromptSource, RolloutLayer, RolloutState
from sparserl.rollout.records import RESUMED, SAMPLED, GroupRecord, SampleRecord
from sparserl.rollout.scheduler import Scheduler, SchedulerStats

__all__ = [
    "RESUMED",
    "SAMPLED",
    "GroupRecord",
    "PromptSource",
    "RolloutLayer",
    "RolloutState",
    "SampleRecord",
    "Scheduler",
    "SchedulerStats",
]
