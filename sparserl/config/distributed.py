"""The distributed section: rollout workers as Ray actors (the `ray` rollout backend). Without these keys nothing
about Ray is imported or started."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparserl.config.errors import ConfigError


@dataclass
class DistributedConfig:
    """Where rollouts run when one process is not enough (docs/distributed.md)."""

    rollout_workers: int = field(
        default=0,
        metadata={
            "help": "Rollout workers, each a Ray actor with its own copy of the model and engine (the 'ray' "
            "rollout backend): the trainer hands them the step's samples and gathers the segments as workers "
            "finish. 0: rollouts in this process (rollout.backend)."
        },
    )
    learners: int = field(
        default=1,
        metadata={
            "help": "Data-parallel learner processes. Only 1 is implemented: more is refused with an error."
        },
    )
    ray_address: str = field(
        default="",
        metadata={
            "help": "Ray cluster to join ('auto', 'ray://host:10001', 'host:6379'); empty: a local Ray started "
            "and stopped by the run."
        },
    )
    cpus_per_worker: float = field(
        default=1.0, metadata={"help": "CPUs each rollout worker reserves (and the threads its torch uses)."}
    )
    gpus_per_worker: float = field(default=0.0, metadata={"help": "GPUs each rollout worker reserves."})
    start_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "Seconds to wait for the workers to start; past it the run stops with an error naming the "
            "resources asked for and those free (never a silent wait)."
        },
    )

    def __post_init__(self) -> None:
        if self.rollout_workers < 0:
            raise ConfigError(f"distributed.rollout_workers={self.rollout_workers} must be >= 0")
        if self.learners != 1:
            raise ConfigError(
                f"distributed.learners={self.learners}: data-parallel learners are not implemented yet; "
                "use distributed.learners=1 (rollout workers scale with distributed.rollout_workers)"
            )
        if self.cpus_per_worker <= 0 or self.gpus_per_worker < 0 or self.start_timeout_s <= 0:
            raise ConfigError(
                f"distributed.cpus_per_worker={self.cpus_per_worker} must be > 0, gpus_per_worker="
                f"{self.gpus_per_worker} >= 0 and start_timeout_s={self.start_timeout_s} > 0"
            )
