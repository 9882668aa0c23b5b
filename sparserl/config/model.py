"""The model section of a run's config: which model is trained, in which precision (float16 with dynamic loss
scaling, the LM head optionally kept in float32), and whether through LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparserl.config.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Which model is trained, in which precision, and whether through LoRA adapters."""

    spec: str = field(
        default="smollm2-135m",
        metadata={
            "help": "Model to train: a Hugging Face id or local directory, a .gguf file, or 'smollm2-135m' "
            "(SmolLM2-135M-Instruct, the embedded default)."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": f"Compute dtype, one of {', '.join(DTYPES)}; float32 is the reference. In half precision "
            "rollouts (and their KV cache) run in it, and scoring and the update run under its autocast; "
            "full fine-tuning keeps float32 master weights and optimizer state, LoRA keeps its frozen base "
            "in it and its adapters in float32. float16 trains with dynamic loss scaling (an update whose "
            "gradient overflows is skipped and the scale halved: train/fp16_overflow_skips; the scale is in "
            "the checkpoint); its narrow range makes it a GPU choice."
        },
    )
    fp32_lm_head: bool = field(
        default=False,
        metadata={
            "help": "Keep the LM head's matmul in float32 under a half-precision model.dtype, on both sides: the "
            "sampler's head and the learner's scoring, so the logits (and log-probs) are rounded once, not "
            "in half precision (ScaleRL's and MiniMax-M1's remedy for the sampler/learner gap; TRL's "
            "cast_lm_head_to_fp32). The head's weight is not converted: full fine-tuning's master weights are "
            "float32 already, LoRA's half base is upcast per call, so tied embeddings stay tied. No effect "
            "at float32."
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "Torch device of the policy (rollouts, scoring and update): 'auto' (cuda when available, "
            "else cpu), or any torch device such as cpu, cuda, cuda:1. Log-probs differ across devices by "
            "float rounding; float32 on the CPU is the reference."
        },
    )
    lora: bool = field(
        default=True,
        metadata={
            "help": "Train LoRA adapters (PEFT) instead of all weights; the reference policy is then the "
            "same model with adapters disabled (no second copy)."
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank r."})
    lora_alpha: float = field(
        default=32.0, metadata={"help": "LoRA scaling alpha (update scaled by alpha/r)."}
    )
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch input."})
    lora_targets: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        metadata={
            "help": "Module names that get adapters (comma-separated on the command line), or 'all-linear'."
        },
    )

    @property
    def weights_dtype(self) -> str:
        """The dtype the weights are kept in: float32 master weights when they are trained (full fine-tuning),
        the compute dtype for LoRA's frozen base."""
        return self.dtype if self.lora else "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        if self.lora and self.lora_r < 1:
            raise ConfigError(f"model.lora_r={self.lora_r} must be >= 1")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"model.lora_dropout={self.lora_dropout} must be in [0, 1)")
        if self.lora and not self.lora_targets:
            raise ConfigError("model.lora_targets is empty: name the modules that get adapters")
