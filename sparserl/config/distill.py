"""The distill section: DistillSparse (Sparrow), a LoRA adapter that exists only on the sparse rollout path and is
trained to close the gap between the sparse sampler and the dense policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparserl.config.errors import ConfigError


@dataclass
class DistillConfig:
    """A second LoRA adapter, on while sampling with block-sparse attention and off everywhere else."""

    enable: bool = field(
        default=False,
        metadata={
            "help": "DistillSparse: add a LoRA adapter that is on only while sampling sparse (and in its "
            "teacher-forced replay), off in dense scoring, the reference and the policy loss. Each step, after "
            "the policy update, the adapter alone is trained with PPO on the sparse-forward log-probs plus "
            "distill.kl_coef x k3-KL to the dense log-probs. Needs sparse rollouts (block_topk, whose reads are "
            "replayed from the queries, or an eviction method, whose held positions are recorded for the replay)."
        },
    )
    adapter_name: str = field(
        default="distill",
        metadata={"help": "PEFT name of the adapter; it must differ from the policy's own ('default')."},
    )
    lora_r: int = field(default=32, metadata={"help": "Rank of the adapter."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling alpha of the adapter."})
    lora_targets: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "Modules that get the adapter (comma-separated), or 'all-linear'."},
    )
    lr_scale: float = field(
        default=5.0,
        metadata={"help": "Adapter learning rate as a multiple of the policy's (its schedule included)."},
    )
    kl_coef: float = field(
        default=0.001,
        metadata={
            "help": "Weight of the k3-KL of the sparse path to the dense policy on the sampled tokens."
        },
    )
    probe_samples: int = field(
        default=8,
        metadata={
            "help": "Size of the fixed probe batch (the first rollouts of the run, kept in the checkpoint) on "
            "which alpha's tail per bin is measured before and after each adapter update; 0: no probe."
        },
    )
    probe_every: int = field(default=1, metadata={"help": "Measure the probe every this many steps (>= 1)."})
    fresh_on_resume: bool = field(
        default=False,
        metadata={
            "help": "Resuming a checkpoint saved without the adapter (distill was off): start a fresh adapter "
            "(and its optimizer) instead of refusing."
        },
    )

    def __post_init__(self) -> None:
        if self.lora_r < 1:
            raise ConfigError(f"distill.lora_r={self.lora_r} must be >= 1")
        if not self.adapter_name or not self.adapter_name.isidentifier():
            raise ConfigError(f"distill.adapter_name={self.adapter_name!r} must be a Python identifier")
        if not self.lora_targets:
            raise ConfigError("distill.lora_targets is empty: name the modules that get the adapter")
        if self.lr_scale <= 0 or self.kl_coef < 0:
            raise ConfigError(
                f"distill.lr_scale={self.lr_scale} must be > 0 and distill.kl_coef={self.kl_coef} >= 0"
            )
        if self.probe_samples < 0 or self.probe_every < 1:
            raise ConfigError(
                f"distill.probe_samples={self.probe_samples} must be >= 0 and "
                f"distill.probe_every={self.probe_every} >= 1"
            )
