"""The sections of a training run's config (model, task, rollout, kv, algo, optim, trainer, logging) and
TrainConfig, which holds them; every field carries a help string (`sparserl train --help` prints them all)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparserl.algo import PRESETS, AlgoConfig
from sparserl.algo.presets import LOSS_PRESETS, preset_names, preset_values
from sparserl.config.checks import cross_section_checks
from sparserl.config.distill import DistillConfig
from sparserl.config.distributed import DistributedConfig
from sparserl.config.engine import EngineConfig
from sparserl.config.errors import ConfigError
from sparserl.config.model import ModelConfig
from sparserl.config.rollout import RolloutConfig
from sparserl.config.sampling import SamplingConfig
from sparserl.config.shaping import ShapingConfig
from sparserl.engine.kv_config import KVConfig
from sparserl.tasks import TaskConfig
from sparserl.tasks.config import GENERATED_TASKS

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SCHEDULES = ("constant", "linear", "cosine")
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
# what optim.recompute_modules may name (trainer/recompute.py): the feed-forward block, rerun whole; the norms'
# outputs and the MLP's activation product, rebuilt elementwise
RECOMPUTE_MODULES = ("mlp", "layernorm", "mlp_act")
DEFAULT_PRESET = "sparse-rl"


# ------------------------------------------------------------------------------------------------ sections


def _kv_default() -> KVConfig:
    return KVConfig(method="rkv", budget=80, interval=16)


# The embedded default's prompts: one-digit sums, and a system message with a worked \boxed{} example so that
# SmolLM2-135M scores often enough (~20%) for GRPO groups to carry signal from the first step.
DEFAULT_SYSTEM_PROMPT = (
    "Reply with the final result inside \\boxed{}. "
    "Example: What is 2 + 3? Answer: 2 + 3 = 5, so the result is \\boxed{5}."
)
DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."


def _task_default() -> TaskConfig:
    return TaskConfig(
        name="arithmetic", max_digits=1, system_prompt=DEFAULT_SYSTEM_PROMPT, instruction=DEFAULT_INSTRUCTION
    )


@dataclass
class AlgoSection(AlgoConfig):
    """AlgoConfig plus the name of the preset it was built from (the preset applies first, keys override)."""

    preset: str = field(
        default=DEFAULT_PRESET,
        metadata={
            "help": "Named algorithm presets applied before the other algo.* keys: a rollout preset (how rollouts "
            f"are sampled and corrected: {', '.join(n for n in PRESETS if n not in LOSS_PRESETS)}), a loss preset "
            f"(it sets only the loss or advantages: {', '.join(LOSS_PRESETS)}), or one of each joined by '+' "
            "(sparse-rl+gspo). A loss preset alone keeps the rollout preset of the config file (default "
            f"{DEFAULT_PRESET}): on the command line, algo.preset replaces only the kinds of preset it names."
        },
    )

    def __post_init__(self) -> None:
        try:
            preset_names(self.preset)
        except ValueError as e:
            raise ConfigError(f"algo.preset={e}") from None
        try:
            super().__post_init__()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_preset(cls, preset: str = DEFAULT_PRESET, **overrides: Any) -> AlgoSection:
        """The preset's values, then `overrides` key by key."""
        try:
            chain, values = preset_values(preset, DEFAULT_PRESET)
        except ValueError as e:
            raise ConfigError(f"algo.preset={e}") from None
        return cls(preset=chain, **{**values, **overrides})


@dataclass
class OptimConfig:
    """AdamW, the learning-rate schedule, and how a rollout batch is cut into optimizer steps."""

    lr: float = field(default=1e-4, metadata={"help": "Peak learning rate of AdamW."})
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.98], metadata={"help": "AdamW betas (beta1, beta2)."}
    )
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW decoupled weight decay."})
    schedule: str = field(
        default="constant",
        metadata={"help": f"Learning-rate schedule after warmup, one of {', '.join(SCHEDULES)}."},
    )
    warmup_steps: int = field(default=0, metadata={"help": "Optimizer steps of linear warmup from 0."})
    grad_clip: float = field(
        default=1.0, metadata={"help": "Clip the global gradient norm to this; 0 disables clipping."}
    )
    mini_batch_size: int = field(
        default=0,
        metadata={
            "help": "Sequences per optimizer step; the rollout batch (prompts_per_step * n) must be a "
            "multiple of it. 0: the whole rollout batch is one mini-batch."
        },
    )
    grad_accum: int = field(
        default=4,
        metadata={
            "help": "Micro-batches each mini-batch is split into (gradient accumulation); bounds the "
            "memory of one forward/backward."
        },
    )
    ppo_epochs: int = field(
        default=1, metadata={"help": "K: passes over the rollout batch before the next rollout."}
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute each decoder layer's activations in the backward instead of keeping them (as "
            "TRL's and transformers' gradient_checkpointing): less update memory for more compute; the learner "
            "then runs each sequence's prompt itself instead of sharing a group's (docs/algorithm.md)."
        },
    )
    recompute_modules: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Sub-modules of every decoder layer whose activations the backward recomputes instead of "
            "keeping (selective recompute: Megatron's and verl's Megatron backend's recompute_modules). 'mlp': the "
            "feed-forward block, most of the update's activations, for one more MLP forward; a group's prompt "
            "stays shared, unlike gradient_checkpointing. 'layernorm': both norms' outputs, and 'mlp_act': the "
            "gated MLP's product silu(gate) * up (Megatron's moe_act for a dense MLP), rebuilt from tensors kept "
            "anyway, elementwise, bit for bit (the default run: both, 193 MiB less at the peak for 7% more "
            "update CPU time). Empty: none."
        },
    )

    def __post_init__(self) -> None:
        if not 0 <= self.lr < math.inf:
            raise ConfigError(f"optim.lr={self.lr} must be a finite number >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas} must be two numbers in [0, 1)")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"optim.schedule={self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}"
            )
        for key in ("warmup_steps", "mini_batch_size", "weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be >= 0")
        for key in ("grad_accum", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be >= 1")
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(
                f"optim.recompute_modules names {unknown}: a decoder layer's recomputable sub-modules are "
                f"{', '.join(RECOMPUTE_MODULES)}"
            )
        if self.recompute_modules and self.gradient_checkpointing:
            raise ConfigError(
                "optim.recompute_modules with optim.gradient_checkpointing=true: whole layers are recomputed "
                "already; set one of them"
            )


@dataclass
class TrainerConfig:
    """Length of the run, seeding, output directory, checkpoints and evaluation."""

    steps: int = field(default=8, metadata={"help": "Training steps (one rollout batch each)."})
    seed: int = field(
        default=0, metadata={"help": "Seeds prompt order, sampling, mini-batch shuffling and LoRA init."}
    )
    output_dir: str = field(default="runs", metadata={"help": "Parent directory of run directories."})
    run_name: str | None = field(
        default=None,
        metadata={"help": "Run directory name under output_dir; null: '<preset>-<kv method>-<timestamp>'."},
    )
    save_every: int = field(
        default=1,
        metadata={"help": "Write a checkpoint every this many steps (and at the end); 0: only at the end."},
    )
    keep_last: int = field(default=2, metadata={"help": "Checkpoints kept on disk (older ones are deleted)."})
    eval_every: int = field(
        default=0,
        metadata={
            "help": "Evaluate on the held-out prompts every this many steps; 0: only before and after."
        },
    )
    eval_prompts: int = field(
        default=32,
        metadata={"help": "Held-out prompts (one sample each) for the reward before/after; 0 disables eval."},
    )
    eval_data: str = field(
        default="",
        metadata={
            "help": "Data source of the held-out prompts (like task.data, same field mapping; a relative path "
            "in a YAML file is relative to that file); empty: the task's 'test' split."
        },
    )
    eval_temperature: float = field(
        default=0.5, metadata={"help": "Sampling temperature of evaluation (> 0)."}
    )
    eval_sparse: bool = field(
        default=False,
        metadata={
            "help": "Evaluation always samples with a dense cache (eval/dense/*); also evaluate with the "
            "training KV policy (eval/sparse/*) when rollouts are sparse."
        },
    )
    threads: int = field(
        default=0,
        metadata={
            "help": "torch CPU threads; 0 leaves torch's default (all cores). The `sparserl` command lets idle "
            "threads spin only ~10 us before they sleep (GOMP_SPINCOUNT=1000), so all cores stay the faster "
            "choice beside another busy process (docs/engine.md, Threads)."
        },
    )
    malloc_mmap_threshold: int = field(
        default=131072,
        metadata={
            "help": "glibc's mmap threshold, in bytes, fixed for the process from the policy's load on (Linux, "
            "glibc): every allocation this large or larger gets its own mapping, returned to the system when "
            "freed. The default 128 KiB keeps the resident peak low (freed activations do not stay resident in "
            "a fragmented heap) but every such tensor is page-faulted afresh: the default train's update takes "
            "about 1.3x the CPU seconds it takes at glibc's own threshold, for a peak 0.7-0.9 GB lower "
            "(docs/engine.md, What returning freed memory costs). 0: glibc's own, growing threshold (the "
            "faster choice when memory is plentiful)."
        },
    )
    reuse_learner_logprobs: bool = field(
        default=True,
        metadata={
            "help": "When a rollout batch gets exactly one optimizer step (ppo_epochs 1, one mini-batch), no "
            "dropout and algo.rejected_in_denominator, take dense pi_old from the learner's own forward pass "
            "instead of a separate scoring pass (the weights have not moved yet, so it is the same policy): "
            "one forward pass less per step. False: always score pi_old separately."
        },
    )
    log_acceptance: bool = field(
        default=False,
        metadata={
            "help": "Log the acceptance rate alpha_t = sum_v min(p_sampler(v), p_dense(v)) of each rollout token "
            "(the sampler against the dense policy on the same prefix, both after temperature/top-k/top-p): its "
            "P5, P1, mean and fraction below acceptance_tau per bin of absolute position (alpha/* metrics). "
            "Costs a dense scoring pass per step, and with acceptance_exact 4 bytes x vocabulary per token."
        },
    )
    acceptance_top_k: int = field(
        default=20,
        metadata={"help": "Top-k log-probs each side records for alpha's top-k lower bound (Sparrow: 20)."},
    )
    acceptance_exact: bool = field(
        default=True,
        metadata={
            "help": "Also log the exact alpha over the whole vocabulary: the sampler keeps its full "
            "distribution per token (196 KB per token at SmolLM2's 49,152 ids) until the step's alpha is taken."
        },
    )
    acceptance_bin: int = field(
        default=512,
        metadata={
            "help": "Width in tokens of alpha's bins of absolute position (prompt + generated so far)."
        },
    )
    acceptance_tau: float = field(
        default=0.86,
        metadata={
            "help": "Acceptance threshold tau in (0, 1]: alpha/*/frac_below_tau counts tokens below it."
        },
    )

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"trainer.steps={self.steps} must be >= 0")
        for key in ("seed", "save_every", "eval_every", "eval_prompts", "threads", "malloc_mmap_threshold"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key}={getattr(self, key)} must be >= 0")
        if self.malloc_mmap_threshold > MAX_MMAP_THRESHOLD:
            raise ConfigError(
                f"trainer.malloc_mmap_threshold={self.malloc_mmap_threshold} is above glibc's largest "
                f"({MAX_MMAP_THRESHOLD}, 32 MiB); 0 leaves glibc's own"
            )
        for key in ("acceptance_top_k", "acceptance_bin"):
            if getattr(self, key) < 1:
                raise ConfigError(f"trainer.{key}={getattr(self, key)} must be >= 1")
        if not 0.0 < self.acceptance_tau <= 1.0:
            raise ConfigError(f"trainer.acceptance_tau={self.acceptance_tau} must be in (0, 1]")
        if self.keep_last < 1:
            raise ConfigError(f"trainer.keep_last={self.keep_last} must be >= 1")
        if not 0 < self.eval_temperature < math.inf:
            raise ConfigError(f"trainer.eval_temperature={self.eval_temperature} must be a finite number > 0")
        if self.run_name is not None and (
            not self.run_name or "/" in self.run_name or self.run_name in (".", "..")
        ):
            raise ConfigError(f"trainer.run_name={self.run_name!r} must be a plain directory name")


@dataclass
class LoggingConfig:
    """Where metrics go: always the console; JSONL and TensorBoard by default; W&B / MLflow / Trackio on
    request; the completions table."""

    jsonl: bool = field(
        default=True, metadata={"help": "Append one JSON line of metrics per step to metrics.jsonl."}
    )
    tensorboard: bool = field(
        default=True, metadata={"help": "Write TensorBoard event files under RUN_DIR/tb."}
    )
    wandb: bool = field(
        default=False, metadata={"help": "Also log to Weights & Biases (needs `pip install wandb`)."}
    )
    wandb_project: str = field(default="sparserl", metadata={"help": "W&B project name."})
    mlflow: bool = field(default=False, metadata={"help": "Also log to MLflow (needs `pip install mlflow`)."})
    mlflow_experiment: str = field(default="sparserl", metadata={"help": "MLflow experiment name."})
    trackio: bool = field(
        default=False, metadata={"help": "Also log to Trackio (needs `pip install trackio`)."}
    )
    trackio_project: str = field(default="sparserl", metadata={"help": "Trackio project name."})
    completions: int = field(
        default=32,
        metadata={
            "help": "Rows per step of the completions table (RUN_DIR/completions.jsonl, and a table in W&B, "
            "MLflow, Trackio and TensorBoard's text tab): prompt, completion, reward, advantage, the sampler's "
            "log-prob gap to pi_old, rejected or not, and what reward functions logged (log_extra); 0: none."
        },
    )
    progress: bool = field(
        default=True, metadata={"help": "Show the live progress bar (reward, length, rejection rate)."}
    )
    print_samples: int = field(
        default=1, metadata={"help": "Completions printed to the console at each evaluation; 0: none."}
    )


@dataclass
class TrainConfig:
    """A whole training run. The defaults are the embedded default run (`sparserl train` with no config)."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "The model being trained."})
    task: TaskConfig = field(
        default_factory=_task_default,
        metadata={
            "help": "Prompts and verifiable rewards. The default run's prompt settings (one-digit sums, a "
            "system message with a \\boxed{} example) apply only while task.name stays 'arithmetic'."
        },
    )
    rollout: RolloutConfig = field(
        default_factory=RolloutConfig, metadata={"help": "Sampling of completions."}
    )
    sampling: SamplingConfig = field(
        default_factory=SamplingConfig,
        metadata={"help": "Which prompts a step spends its rollouts on, and how many samples each gets."},
    )
    kv: KVConfig = field(
        default_factory=_kv_default,
        metadata={"help": "KV cache of the sampler (used when the algo preset samples sparse rollouts)."},
    )
    algo: AlgoSection = field(
        default_factory=AlgoSection.from_preset,
        metadata={"help": "Advantages, corrections and loss (a preset, then key-by-key overrides)."},
    )
    shaping: ShapingConfig = field(
        default_factory=ShapingConfig,
        metadata={
            "help": "Advantage shaping after algo.adv_transforms: uniqueness-aware weights (docs/uniqueness.md)."
        },
    )
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "Optimizer and schedule."})
    trainer: TrainerConfig = field(
        default_factory=TrainerConfig, metadata={"help": "Run length, seeds, checkpoints."}
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Metric sinks."})
    engine: EngineConfig = field(
        default_factory=EngineConfig, metadata={"help": "How the rollout engine runs (compiled or eager)."}
    )
    distill: DistillConfig = field(
        default_factory=DistillConfig,
        metadata={"help": "DistillSparse: a LoRA adapter on the sparse rollout path only (docs/distill.md)."},
    )
    distributed: DistributedConfig = field(
        default_factory=DistributedConfig,
        metadata={"help": "Rollout workers on Ray (docs/distributed.md)."},
    )
    plugins: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Python modules imported (like `python -m`: sys.path, then the working directory) before "
            "the rest of the config is checked, so that the systems they register can be selected: e.g. "
            "plugins=[my_loss] algo.policy_loss=NAME. In the trainer's process only (not in Ray workers). "
            "CONTRIBUTING.md has one example per registry."
        },
    )

    def __post_init__(self) -> None:
        if self.algo.loss_agg_mode == "seq-mean-token-sum-norm" and self.algo.loss_token_norm is None:
            # Dr. GRPO divides by a constant; a batch's padded length would make the objective depend on
            # grad_accum and on which sequences share a micro-batch
            self.algo.loss_token_norm = self.rollout.max_new_tokens
        self.validate()

    def eval_task_config(self) -> TaskConfig:
        """The held-out prompts: the task's own 'test' split, or trainer.eval_data read as a dataset (a
        procedural task's name is replaced by the data source, since such tasks read no data)."""
        if not self.trainer.eval_data:
            return self.task
        name = self.trainer.eval_data if self.task.name in GENERATED_TASKS else self.task.name
        return dataclasses.replace(self.task, name=name, data=self.trainer.eval_data, split="test")

    def validate(self) -> None:
        """Cross-section checks (each section checks its own fields): config/checks.py."""
        cross_section_checks(self)

    @property
    def rollout_batch(self) -> int:
        """Sequences sampled per step."""
        return self.rollout.prompts_per_step * self.rollout.n

    @property
    def sparse(self) -> bool:
        """True when rollouts are sampled sparse: on an evicting KV cache, or reading only some of its pages."""
        return bool(self.algo.sparse_rollout) and self.kv.sparse

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-safe) that `config_from_dict` turns back into an equal config."""
        return dataclasses.asdict(self)
