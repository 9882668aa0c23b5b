"""What `sparserl eval` and `sparserl rollout` evaluate: a model (a training run's exported model or
checkpoint, a Hugging Face id or folder, a .gguf file, smollm2-135m) and prompts (an eval file, gsm8k test,
a built-in procedural task, or a training run's own task)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from sparserl.config import ConfigError
from sparserl.errors import UserError

RUN_CONFIG = "config.yaml"  # sparserl.trainer.loop.CONFIG_FILE
RUN_EXPORT = "final"  # sparserl.trainer.loop.EXPORT_DIR
CHECKPOINT_STATE = "trainer_state.json"  # sparserl.trainer.checkpoint.STATE_FILE
PROCEDURAL_TASKS = ("arithmetic", "long_arithmetic")
PROCEDURAL_DEFAULT_LIMIT = 200
EVAL_SETS = ("math500", "aime24", "amc23", "gaokao2023en", "minerva_math", "olympiadbench")


@dataclass
class LoadedModel:
    """A model ready for the engine, its tokenizer, and where it came from (for the report)."""

    model: Any
    tokenizer: Any
    source: str
    kind: str  # 'run-final', 'run-checkpoint', 'pretrained'
    path: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def is_run_dir(path: str | Path) -> bool:
    """A sparserl training run directory (it holds the run's config.yaml)."""
    return (Path(path) / RUN_CONFIG).is_file()


def run_config(run_dir: str | Path) -> Any:
    """The TrainConfig a run was started with."""
    from sparserl.config import load_config

    return load_config(Path(run_dir) / RUN_CONFIG)


def pruned_message(ckpt: Path) -> str:
    """What to say when a checkpoint's files vanish while eval reads them: a training still running on the
    run directory keeps only its newest checkpoints (trainer.keep_last) and deleted this one."""
    return (
        f"the checkpoint {ckpt} was removed while reading (pruned by a running training?); run the command "
        "again to read the run's latest checkpoint"
    )


def _load_checkpoint_model(run_dir: Path, ckpt: Path, dtype: str | None) -> tuple[Any, Any, dict]:
    """The run's base model with the checkpoint's weights; LoRA adapters are loaded through PEFT and merged
    (a DistillSparse run's are kept as adapters, its sparse-path adapter registered with the engine)."""
    from safetensors.torch import load_file

    from sparserl.models import ModelLoadError
    from sparserl.trainer.checkpoint import PART_WEIGHTS
    from sparserl.trainer.distill import DISTILL_PART
    from sparserl.trainer.policy import Policy

    cfg = run_config(run_dir)
    model_cfg = replace(cfg.model, dtype=dtype) if dtype else cfg.model
    files = sorted(ckpt.glob("*.safetensors"))
    if len(files) != 1:
        if not ckpt.is_dir():
            raise ModelLoadError(pruned_message(ckpt))
        raise FileNotFoundError(f"{ckpt}: expected one .safetensors weights file, found {len(files)}")
    distill = cfg.distill if cfg.distill.enable else None
    policy = Policy(model_cfg, distill=distill)
    try:
        policy.load_weights(load_file(files[0]))
        if distill is not None:  # the sparse path's adapter stays a switch, on in sparse engines only
            policy.load_adapter_weights(policy.distill_adapter, load_file(ckpt / DISTILL_PART / PART_WEIGHTS))
    except Exception as e:  # noqa: BLE001 - re-raised naming the checkpoint
        if not (ckpt.is_dir() and files[0].is_file()):  # gone since the glob above: not a mismatch
            raise ModelLoadError(pruned_message(ckpt)) from e
        raise ModelLoadError(f"checkpoint {ckpt} does not fit model {model_cfg.spec!r}: {e}") from e
    model = policy.peft.merge_and_unload() if policy.peft is not None and distill is None else policy.module
    info = {"base_model": model_cfg.spec, "lora": bool(model_cfg.lora), "weights": str(files[0]),
            "sparse_adapter": policy.distill_adapter}  # fmt: skip
    return model, policy.tokenizer, info


def load_eval_model(
    spec: str,
    dtype: str | None = None,
    device: str | torch.device = "cpu",
    use_checkpoint: bool = False,
) -> LoadedModel:
    """Load what `spec` names. A run directory gives its exported final model, or (no export yet, or
    `use_checkpoint`) its latest checkpoint: the base model from the run's config plus the saved weights or
    LoRA adapter. A checkpoint directory (RUN_DIR/checkpoints/step-N) gives that checkpoint. Anything else
    goes to `sparserl.models.load_model` (Hugging Face id or folder, .gguf, smollm2-135m); 'tiny-llama' and
    'tiny-qwen3' build the random test models."""
    from sparserl.models import load_model
    from sparserl.trainer import latest_checkpoint

    torch_dtype = getattr(torch, dtype) if dtype else torch.float32
    path = Path(spec)
    if path.is_dir() and (path / CHECKPOINT_STATE).is_file() and is_run_dir(path.parent.parent):
        model, tok, info = _load_checkpoint_model(path.parent.parent, path, dtype)
        loaded = LoadedModel(model, tok, spec, "run-checkpoint", str(path), info)
    elif path.is_dir() and is_run_dir(path):
        final = path / RUN_EXPORT
        ckpt = latest_checkpoint(path)
        # a DistillSparse run's export is its dense policy: its sparse path needs the checkpoint's adapter
        if (final / "config.json").is_file() and not use_checkpoint and not run_config(path).distill.enable:
            model, tok = load_model(str(final), dtype=torch_dtype)
            loaded = LoadedModel(model, tok, spec, "run-final", str(final))
        elif ckpt is not None:
            model, tok, info = _load_checkpoint_model(path, ckpt, dtype)
            loaded = LoadedModel(model, tok, spec, "run-checkpoint", str(ckpt), info)
        else:
            raise FileNotFoundError(
                f"run directory {spec} has neither an exported model ({RUN_EXPORT}/) nor a checkpoint yet"
            )
    else:
        model, tok = load_model(spec, dtype=torch_dtype)
        loaded = LoadedModel(model, tok, spec, "pretrained", spec)
    loaded.model = loaded.model.to(device).eval()
    return loaded


DATA_DIR_ENV = "SPARSERL_DATA_DIR"
"""A folder of local evaluation files (`gsm8k/{split}.jsonl`, `eval/{name}.jsonl`) that `--data gsm8k` and the eval
set names resolve to; several folders separated by the path separator (':'), searched in order."""


def data_dirs() -> list[Path]:
    """The folders named by `$SPARSERL_DATA_DIR` (none when unset); one that is not a folder is a UserError."""
    named = [Path(d).expanduser() for d in os.environ.get(DATA_DIR_ENV, "").split(os.pathsep) if d]
    missing = [str(d) for d in named if not d.is_dir()]
    if missing:
        raise UserError(f"${DATA_DIR_ENV} names {', '.join(missing)}, which is not a folder")
    return named


def _local_named(name: str, split: str) -> Path | None:
    """The local file for 'gsm8k' (its `split`) or one of the Sparse-RL eval sets, if a data folder holds it."""
    rel = f"gsm8k/{split}.jsonl" if name == "gsm8k" else f"eval/{name}.jsonl" if name in EVAL_SETS else None
    if rel is None:
        return None
    for d in data_dirs():
        if (d / rel).is_file():
            return d / rel
    return None


def eval_task_config(
    data: str,
    split: str = "test",
    question_key: str = "",
    answer_key: str = "",
    base: Any = None,
    prompt_template: str = "",
) -> Any:
    """The TaskConfig for `--data`: a local .jsonl/.json/.parquet file, 'gsm8k' (the local file when
    $SPARSERL_DATA_DIR holds one, else openai/gsm8k), an eval set name (math500, aime24, ...: its local file),
    'math', a built-in procedural task (arithmetic, long_arithmetic) or a Hugging Face dataset name. `base` (a run's TaskConfig)
    supplies the prompt format (instruction, system prompt) and the procedural settings; the data source and
    field mapping (question/answer keys, `prompt_template` over row fields) come from `data` and the
    arguments. Eval scores correctness: the format reward and the run's own reward functions are off."""
    from sparserl.tasks import TaskConfig
    from sparserl.tasks.dataset import is_local_source

    base = base if base is not None else TaskConfig()
    # From a run's task keep the prompt format and procedural settings, not its data source, field mapping
    # or reward shaping.
    common = {
        "format_weight": 0.0,
        "reward": [],
        "reward_weights": [],
        "split": split,
        "question_key": question_key,
        "answer_key": answer_key,
        "prompt_template": prompt_template,
        "max_examples": 0,
    }
    if is_local_source(data):
        if not Path(data).is_file():
            raise FileNotFoundError(f"--data {data}: no such file")
        return replace(base, name=str(data), data=str(data), data_config="", **common)
    if data in PROCEDURAL_TASKS:
        return replace(base, name=data, data="", data_config="", **common)
    local = _local_named(data, split)
    if local is not None:
        return replace(base, name=data, data=str(local), data_config="", **common)
    if data in EVAL_SETS:
        raise FileNotFoundError(
            f"--data {data}: no folder in ${DATA_DIR_ENV} holds eval/{data}.jsonl; give the path of the eval "
            f"set's .jsonl file, or set ${DATA_DIR_ENV} to the folder that holds eval/{data}.jsonl"
        )
    if "/" not in data and data not in ("gsm8k", "math"):  # like make_task: a Hub name is owner/name
        raise ConfigError(
            f"--data {data!r} is unknown: give a .jsonl/.json/.parquet file, gsm8k, math, "
            f"{', '.join(EVAL_SETS)}, {', '.join(PROCEDURAL_TASKS)}, or a Hugging Face dataset (owner/name)"
        )
    source = "" if data in ("gsm8k", "math") else data  # '': the task's default Hugging Face dataset
    return replace(base, name=data, data=source, data_config="", **common)


def load_eval_task(
    data: str | None,
    split: str = "test",
    model_spec: str | None = None,
    question_key: str = "",
    answer_key: str = "",
    prompt_template: str = "",
) -> Any:
    """The task `--data` names; with no `--data` and a run directory as the model, the run's own task
    (its held-out split)."""
    from sparserl.tasks import make_task

    base = run_config(model_spec).task if model_spec and is_run_dir(model_spec) else None
    if data is None:
        if base is None:
            raise ConfigError(
                "--data is required (an eval .jsonl file, gsm8k, math500, arithmetic, long_arithmetic, ...) "
                "unless --model is a training run directory"
            )
        cfg = replace(base, format_weight=0.0, reward=[], reward_weights=[], split=split)
    else:
        cfg = eval_task_config(data, split, question_key, answer_key, base, prompt_template)
    return make_task(cfg, split)


def default_max_new_tokens(model_spec: str | None) -> int:
    """The completion length cap when --max-new-tokens is not given: the length a run directory trained with,
    else training's default (rollout.max_new_tokens), so eval neither preallocates nor waits for far more."""
    from sparserl.config.rollout import RolloutConfig

    if model_spec and is_run_dir(model_spec):
        return run_config(model_spec).rollout.max_new_tokens
    return RolloutConfig().max_new_tokens


def default_limit(task: Any) -> int:
    """How many prompts to evaluate when --limit is not given: every row of a dataset, a bounded number of
    the procedural tasks (they have `task.num_examples` problems, 10000 by default)."""
    name = getattr(task, "name", "")
    if name in PROCEDURAL_TASKS:
        return min(len(task), PROCEDURAL_DEFAULT_LIMIT)
    return len(task)
