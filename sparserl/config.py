"""The one typed config of a training run: YAML file + `key.sub=value` overrides -> TrainConfig.

Every field carries a help string (`metadata={"help": ...}`); `sparserl train --help` prints them all.
Loading is strict: an unknown key is an error listing the valid keys, a value that does not fit the field's
type is an error naming the key (and the file and line when it came from YAML).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from sparserl.algo import PRESETS, AlgoConfig
from sparserl.engine.kv_config import KVConfig
from sparserl.errors import UserError
from sparserl.tasks import TaskConfig
from sparserl.tasks.config import GENERATED_TASKS

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("constant", "linear", "cosine")
DEFAULT_PRESET = "sparse-rl"


class ConfigError(UserError):
    """A config file or override that does not fit TrainConfig; the message names the culprit."""


# ------------------------------------------------------------------------------------------------ sections


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
        default="float32", metadata={"help": f"Weights dtype, one of {', '.join(DTYPES)} (CPU: float32)."}
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

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
        if self.lora and self.lora_r < 1:
            raise ConfigError(f"model.lora_r={self.lora_r} must be >= 1")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"model.lora_dropout={self.lora_dropout} must be in [0, 1)")
        if self.lora and not self.lora_targets:
            raise ConfigError("model.lora_targets is empty: name the modules that get adapters")


@dataclass
class RolloutConfig:
    """How many completions are sampled per step, and how."""

    prompts_per_step: int = field(default=4, metadata={"help": "Prompts drawn from the task per step."})
    n: int = field(default=8, metadata={"help": "Completions sampled per prompt: the GRPO group size G."})
    max_new_tokens: int = field(
        default=64, metadata={"help": "Completion length cap; longer ones finish with reason 'length'."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(
        default=1.0, metadata={"help": "Nucleus sampling: keep the smallest set with mass >= top_p."}
    )
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens; 0 disables."})
    stop: list[str] = field(
        default_factory=list,
        metadata={"help": "Extra stop strings (the tokenizer's EOS always stops a completion)."},
    )

    def __post_init__(self) -> None:
        for key in ("prompts_per_step", "n", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"rollout.{key}={getattr(self, key)} must be >= 1")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"rollout.temperature={self.temperature} must be a finite number > 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"rollout.top_k={self.top_k} must be >= 0")


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
            "help": f"Named algorithm preset applied before the other algo.* keys: one of {', '.join(PRESETS)}."
        },
    )

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"algo.preset={self.preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        try:
            super().__post_init__()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def from_preset(cls, preset: str = DEFAULT_PRESET, **overrides: Any) -> AlgoSection:
        """The preset's values, then `overrides` key by key."""
        if preset not in PRESETS:
            raise ConfigError(f"algo.preset={preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        return cls(preset=preset, **{**PRESETS[preset], **overrides})


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
        default=0, metadata={"help": "torch CPU threads; 0 leaves torch's default (all cores)."}
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

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"trainer.steps={self.steps} must be >= 0")
        for key in ("save_every", "eval_every", "eval_prompts", "threads"):
            if getattr(self, key) < 0:
                raise ConfigError(f"trainer.{key}={getattr(self, key)} must be >= 0")
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
    """Where metrics go: always the console; JSONL and TensorBoard by default; W&B / MLflow on request."""

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
    kv: KVConfig = field(
        default_factory=_kv_default,
        metadata={"help": "KV cache of the sampler (used when the algo preset samples sparse rollouts)."},
    )
    algo: AlgoSection = field(
        default_factory=AlgoSection.from_preset,
        metadata={"help": "Advantages, corrections and loss (a preset, then key-by-key overrides)."},
    )
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "Optimizer and schedule."})
    trainer: TrainerConfig = field(
        default_factory=TrainerConfig, metadata={"help": "Run length, seeds, checkpoints."}
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "Metric sinks."})

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
        """Cross-section checks (each section checks its own fields)."""
        batch = self.rollout.prompts_per_step * self.rollout.n
        if self.algo.group_size != self.rollout.n:
            raise ConfigError(
                f"algo.group_size={self.algo.group_size} differs from rollout.n={self.rollout.n}; "
                "the group is the n completions of one prompt: set rollout.n and leave algo.group_size unset"
            )
        mini = self.optim.mini_batch_size or batch
        if batch % mini:
            raise ConfigError(
                f"optim.mini_batch_size={mini} must divide the rollout batch "
                f"(rollout.prompts_per_step * rollout.n = {batch})"
            )
        if self.optim.grad_accum > mini:
            raise ConfigError(
                f"optim.grad_accum={self.optim.grad_accum} exceeds the mini-batch size {mini}: "
                "each micro-batch needs at least one sequence"
            )
        if self.algo.sparse_rollout and not self.kv.evicting:
            raise ConfigError(
                f"algo.preset={self.algo.preset!r} samples sparse rollouts but kv.method={self.kv.method!r}; "
                "set kv.method to an evicting method (rkv, snapkv, h2o, streaming_llm, random) "
                "or use algo.preset=dense"
            )

    @property
    def rollout_batch(self) -> int:
        """Sequences sampled per step."""
        return self.rollout.prompts_per_step * self.rollout.n

    @property
    def sparse(self) -> bool:
        """True when rollouts are sampled on the evicting KV cache."""
        return bool(self.algo.sparse_rollout) and self.kv.evicting

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML-safe) that `config_from_dict` turns back into an equal config."""
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------ typing


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (typed YAML, or a command-line string) to the field type `tp`, or raise ConfigError."""
    optional, inner = _is_optional(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return coerce(value, inner, key)
    bad = ConfigError(f"{key}={value!r} is not a valid {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    raise bad from None
                if f.is_integer():
                    return int(f)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            number = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise bad from None
        if math.isnan(number):  # no setting means anything with NaN; it would pass every `<` check silently
            raise ConfigError(f"{key}={value!r} is not a number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = yaml.safe_load(text)
                except yaml.YAMLError:
                    raise bad from None
            else:
                value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp) or (Any, Any)
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                raise bad from None
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise bad
        return {coerce(k, k_tp, key): coerce(v, v_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    raise ConfigError(f"{key}: fields of type {_type_name(tp)} are not supported by the config loader")


# ------------------------------------------------------------------------------------------------ building


class _Where:
    """Where each key path came from (file:line, or 'command line'), for error messages."""

    def __init__(self) -> None:
        self.places: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        place = self.places.get(key)
        return f"{place}: " if place else ""


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    scope = f"under '{parent}'" if parent else "at the top level"
    return ConfigError(f"{where}unknown config key '{key}'{hint}; valid keys {scope}: {', '.join(valid)}")


def _build(cls: type, data: Any, prefix: str, where: _Where) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where(prefix)}'{prefix}' must be a mapping of keys to values, got {data!r}")
    hints = _field_types(cls)
    valid = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in valid:
            raise _unknown_key_error(path, valid, where(path))
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            continue
        if isinstance(value, dict) and typing.get_origin(_is_optional(tp)[1]) is not dict:
            raise ConfigError(
                f"{where(path)}'{path}' is not a section: it takes one {_type_name(tp)} value (e.g. {path}=...)"
            )
        try:
            kwargs[key] = coerce(value, tp, path)
        except ConfigError as e:
            raise ConfigError(f"{where(path)}{e}") from None
    for key in valid:
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            path = f"{prefix}.{key}" if prefix else key
            section = data.get(key) or {}
            if not isinstance(section, dict):
                raise ConfigError(
                    f"{where(path)}'{path}' must be a mapping of keys to values, got {section!r}"
                )
            f = next(f for f in fields(cls) if f.name == key)
            if tp is not AlgoSection and f.default_factory is not dataclasses.MISSING:
                # start from this config's default for the section (e.g. kv defaults to R-KV), then override
                base = f.default_factory()
                if tp is TaskConfig and section.get("data") and "name" not in section:
                    section = {**section, "name": section["data"]}  # a data path selects the dataset task
                if tp is TaskConfig and section.get("name", base.name) != base.name:
                    base = (
                        TaskConfig()
                    )  # another task: the default run's arithmetic prompt does not carry over
                section = {**{g.name: getattr(base, g.name) for g in fields(base)}, **section}
            else:
                section = dict(section)
            if cls is TrainConfig and key == "algo" and "group_size" not in section:
                section["group_size"] = kwargs["rollout"].n  # the group is rollout.n; set it once
            kwargs[key] = _build(tp, section, path, where)
    if cls is AlgoSection:
        preset = kwargs.pop("preset", DEFAULT_PRESET)
        if preset not in PRESETS:
            key = f"{prefix}.preset"
            raise ConfigError(f"{where(key)}{key}={preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        return _construct(lambda: AlgoSection.from_preset(preset, **kwargs), prefix, where)
    return _construct(lambda: cls(**kwargs), prefix, where)


def _construct(make: Any, prefix: str, where: _Where) -> Any:
    try:
        return make()
    except ConfigError as e:
        raise ConfigError(f"{where(prefix)}{e}") from None
    except (ValueError, TypeError) as e:
        label = f"'{prefix}'" if prefix else "config"
        raise ConfigError(f"{where(prefix)}invalid {label}: {e}") from None


def config_from_dict(data: dict[str, Any], where: _Where | None = None) -> TrainConfig:
    """Build a TrainConfig from a nested dict (missing keys keep their defaults; algo.preset applies first)."""
    return _build(TrainConfig, data, "", where or _Where())


def _yaml_lines(text: str, source: str, where: _Where) -> None:
    """Record file:line for every key path of a YAML document."""

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}.{k.value}" if prefix else str(k.value)
                where.places[key] = f"{source}:{k.start_mark.line + 1}"
                walk(v, key)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return
    if root is not None:
        walk(root, "")


DATA_PATH_KEYS = (("task", "data"), ("trainer", "eval_data"))


def _resolve_data_paths(data: dict[str, Any], config_file: Path) -> None:
    """Make relative local data paths of a YAML file relative to that file, not to the working directory, so
    a config (and the presets in configs/) works from anywhere. Hugging Face dataset names are left alone."""
    from sparserl.tasks.dataset import is_local_source

    for section, key in DATA_PATH_KEYS:
        value = (data.get(section) or {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and is_local_source(value) and not os.path.isabs(value):
            data[section][key] = os.path.normpath(config_file.resolve().parent / os.path.expanduser(value))


def resolve_config_path(name: str | Path) -> Path:
    """A YAML path, or the name of a run preset in configs/ ('default' -> configs/default.yaml)."""
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / f"{name}.yaml", CONFIG_DIR / str(name)):
        if candidate.is_file():
            return candidate
    presets = ", ".join(list_run_presets()) or "(none found)"
    raise ConfigError(
        f"config {str(name)!r} is neither a file nor a run preset in {CONFIG_DIR}; presets: {presets}"
    )


def list_run_presets() -> list[str]:
    """Names of the YAML run presets shipped in configs/."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []


def parse_override(text: str) -> tuple[list[str], str]:
    """'optim.lr=1e-5' -> (['optim', 'lr'], '1e-5')."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. optim.lr=1e-5)")
    key, value = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"override {text!r}: the key {key!r} is malformed (expected section.key=value)")
    return parts, value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config (None: the embedded default), apply `key.sub=value` overrides, check everything."""
    where = _Where()
    data: dict[str, Any] = {}
    if path is not None:
        path = resolve_config_path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r})"
            ) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model, task, ...)")
        data = loaded
        _yaml_lines(text, str(path), where)
        _resolve_data_paths(data, path)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(parts[: i + 1])}' is not a section")
            node = child
        node[parts[-1]] = value
        where.places[".".join(parts)] = f"command line '{text}'"
    return config_from_dict(data, where)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write `cfg` as YAML that `load_config` reads back into an equal config."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ------------------------------------------------------------------------------------------------ help


def iter_fields(cls: type = TrainConfig, prefix: str = "") -> typing.Iterator[tuple[str, str, str]]:
    """(key path, type name, help) for every leaf field, in declaration order."""
    hints = _field_types(cls)
    for f in fields(cls):
        tp = hints[f.name]
        path = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(tp, path)
        else:
            yield path, _type_name(tp), f.metadata.get("help", "")


def format_help() -> str:
    """Every config key with its type, default and help, grouped by section."""
    lines: list[str] = []
    section = None
    default = TrainConfig()
    for path, tp, help_text in iter_fields():
        head = path.split(".", 1)[0]
        if head != section:
            section = head
            sec_help = next(f for f in fields(TrainConfig) if f.name == head).metadata.get("help", "")
            lines.append(f"\n{head}: {sec_help}")
        value = default
        for part in path.split("."):
            value = getattr(value, part)
        lines.append(f"  {path} ({tp}, default {value!r})\n      {help_text}")
    return "\n".join(lines)
