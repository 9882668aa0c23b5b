"""The distributed section: rollout workers as Ray actors (the `ray` rollout backend), data-parallel learner
ranks (trainer/learner_group.py) and SAPO's swarm of trainers sharing rollouts. Without these keys nothing about Ray is imported or started."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparserl.config.errors import ConfigError

SWARM_CORRECTIONS = ("ratio1", "sender_logp")
# auto + the names in WEIGHT_SYNCS (sparserl/distributed/weight_sync.py), written out because the rollout package
# imports the config; tests/test_weight_sync.py keeps the two equal
WEIGHT_SYNC_CHOICES = ("auto", "object_store", "broadcast")


@dataclass
class SwarmConfig:
    """SAPO: trainers (nodes) that share finished rollouts through a pool, never weights."""

    enable: bool = field(
        default=False,
        metadata={
            "help": "Publish this node's trained groups (prompt row, tokens, text, sampler log-probs) to the "
            "swarm's pool, a Ray actor, and train each step on rollout.prompts_per_step local groups plus "
            "swarm.shared_groups groups drawn from the other nodes (rewards recomputed here). Nodes must run "
            "the same task."
        },
    )
    node: int = field(default=0, metadata={"help": "This node's id in the swarm (distinct per node)."})
    pool: str = field(
        default="",
        metadata={
            "help": "Name of the pool actor, required with swarm.enable: nodes on one Ray cluster sharing this "
            "name form a swarm. The pool outlives the runs (a detached actor), so each swarm needs a name of its "
            "own (e.g. the experiment's and its seed): a later swarm under an earlier one's name draws its groups."
        },
    )
    shared_groups: int = field(
        default=0, metadata={"help": "J: groups drawn each step from the other nodes (0: only publish)."}
    )
    window: int = field(
        default=64,
        metadata={"help": "Groups are drawn from the other nodes' latest this-many published groups."},
    )
    correction: str = field(
        default="ratio1",
        metadata={
            "help": "Sampler log-prob recorded for shared tokens: 'ratio1' (this node's current policy, so the "
            "corrections see ratio 1: SAPO's on-policy treatment) or 'sender_logp' (the sender's sampler "
            "log-probs, where its tokenizer is this node's, so the corrections weigh them as off-policy tokens; "
            "otherwise ratio1, counted)."
        },
    )

    def __post_init__(self) -> None:
        if self.enable and not self.pool.strip():
            raise ConfigError(
                f"distributed.swarm.pool={self.pool!r} must name the pool actor, one name per swarm (e.g. the "
                "experiment's and its seed): the pool outlives the runs on its Ray cluster, so a later swarm "
                "under an earlier one's name would draw that swarm's groups"
            )
        if self.shared_groups < 0 or self.window < 1:
            raise ConfigError(
                f"distributed.swarm.shared_groups={self.shared_groups} must be >= 0 and window={self.window} >= 1"
            )
        if self.correction not in SWARM_CORRECTIONS:
            raise ConfigError(
                f"distributed.swarm.correction={self.correction!r}: choose one of {', '.join(SWARM_CORRECTIONS)}"
            )


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
            "help": "Data-parallel learners: 1 trains in this process; N > 1 starts N Ray actors at once (a "
            "placement group), each with a copy of the policy, that share every mini-batch's optim.grad_accum "
            "micro-batches (a multiple of N) and sum their gradients (torch.distributed: gloo on CPU, nccl on "
            "GPU) before each step, so the update is the one of 1 learner."
        },
    )
    fsdp: bool = field(
        default=False,
        metadata={
            "help": "Shard the learner ranks' policy (PyTorch FSDP2): each rank holds 1/N of the trainable weights, "
            "their gradients and AdamW's state, and gathers a decoder layer's weights only around its forward and "
            "backward, instead of a whole copy each (needs distributed.learners >= 2; checkpoints keep the "
            "one-learner format)."
        },
    )
    cpus_per_learner: float = field(
        default=1.0, metadata={"help": "CPUs each learner rank reserves (and the threads its torch uses)."}
    )
    gpus_per_learner: float = field(
        default=0.0,
        metadata={"help": "GPUs each learner rank reserves; > 0 puts its policy copy on a GPU (nccl)."},
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
    weight_sync: str = field(
        default="auto",
        metadata={
            "help": "How each policy version's trainable tensors reach the rollout workers: 'object_store' (one "
            "ray.put, each worker fetches a copy), 'broadcast' (one torch.distributed group of the trainer and "
            "the workers: gloo on CPU, nccl where the workers hold GPUs), 'auto' (broadcast when "
            "gpus_per_worker > 0, else object_store)."
        },
    )
    start_timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "Seconds to wait for the workers to start; past it the run stops with an error naming the "
            "resources asked for and those free (never a silent wait). Also bounds forming the weight "
            "broadcast group and each broadcast."
        },
    )

    swarm: SwarmConfig = field(
        default_factory=SwarmConfig,
        metadata={"help": "SAPO: rollouts shared between trainers (docs/distributed.md)."},
    )

    def __post_init__(self) -> None:
        if self.rollout_workers < 0:
            raise ConfigError(f"distributed.rollout_workers={self.rollout_workers} must be >= 0")
        if self.learners < 1:
            raise ConfigError(f"distributed.learners={self.learners} must be >= 1")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker < 0 or self.start_timeout_s <= 0:
            raise ConfigError(
                f"distributed.cpus_per_worker={self.cpus_per_worker} must be > 0, gpus_per_worker="
                f"{self.gpus_per_worker} >= 0 and start_timeout_s={self.start_timeout_s} > 0"
            )
        if self.weight_sync not in WEIGHT_SYNC_CHOICES:
            raise ConfigError(
                f"distributed.weight_sync={self.weight_sync!r}: choose one of {', '.join(WEIGHT_SYNC_CHOICES)}"
            )
        if self.fsdp and self.learners < 2:
            raise ConfigError(
                f"distributed.fsdp=true shards the policy over learner ranks: it needs distributed.learners >= 2 "
                f"(got {self.learners})"
            )
        if self.cpus_per_learner <= 0 or self.gpus_per_learner < 0:
            raise ConfigError(
                f"distributed.cpus_per_learner={self.cpus_per_learner} must be > 0 and gpus_per_learner="
                f"{self.gpus_per_learner} >= 0"
            )

    @property
    def learner_ranks(self) -> int:
        """Learner actors the run starts: none when the one learner trains in the trainer's process."""
        return self.learners if self.learners > 1 else 0

    def local_ray_cpus(self) -> float:
        """CPUs a Ray started by the run needs for its actors (rollout workers and learner ranks)."""
        return self.rollout_workers * self.cpus_per_worker + self.learner_ranks * self.cpus_per_learner
