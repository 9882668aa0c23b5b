"""The TRL arm of benchmarks/rl_step.py, run in a child process of its own (`--child trl`): TRL's GRPOTrainer
configured as the resolved sparserl config, with every step timed the way the sparserl arm's steps are; and the
per-step rows both arms share."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch


def trl_config_kwargs(cfg: Any, steps: int, output_dir: str) -> dict[str, Any]:
    """GRPOConfig keywords equal to the resolved sparserl config `cfg` (see DIFFERENCES for what is not)."""
    o, r, g = cfg.optim, cfg.rollout, cfg.optim.grad_accum
    return {
        "output_dir": output_dir, "num_generations": r.n, "per_device_train_batch_size": r.n // g,
        "gradient_accumulation_steps": g,  # steps_per_generation = g: one generation of 1 x n per step
        "max_completion_length": r.max_new_tokens, "temperature": r.temperature, "top_p": r.top_p,
        "top_k": r.top_k, "learning_rate": o.lr, "adam_beta1": o.betas[0], "adam_beta2": o.betas[1],
        "adam_epsilon": o.eps, "weight_decay": o.weight_decay, "max_grad_norm": o.grad_clip,
        "lr_scheduler_type": "constant", "warmup_steps": 0, "beta": cfg.algo.kl_coef, "epsilon": cfg.algo.eps_low,
        "epsilon_high": cfg.algo.eps_high, "loss_type": "grpo", "scale_rewards": "group", "num_iterations": 1,
        "max_steps": steps, "seed": cfg.trainer.seed, "shuffle_dataset": False, "gradient_checkpointing": False,
        "use_cpu": True, "bf16": cfg.model.dtype == "bfloat16", "fp16": False, "logging_steps": 1,
        "report_to": "none", "save_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0,
    }  # fmt: skip


def step_row(step, wall, cpu, rollout, scoring, update, tokens) -> dict[str, Any]:
    return {
        "step": int(step), "wall_s": wall, "cpu_s": cpu, "rollout_s": rollout, "scoring_s": scoring,
        "update_s": update, "completion_tokens": int(tokens),
        "completion_tokens_per_s": tokens / wall if wall > 0 else 0.0,
    }  # fmt: skip


def print_step(arm: str, r: dict[str, Any]) -> None:
    cpu = f"{r['cpu_s']:.2f}" if r["cpu_s"] is not None else "-"
    print(f"{arm:>8} step {r['step']}: {r['wall_s']:.2f} s (cpu {cpu} s) = rollout {r['rollout_s']:.2f} + scoring "
          f"{r['scoring_s']:.2f} + update {r['update_s']:.2f}; {r['completion_tokens']} tokens, "
          f"{r['completion_tokens_per_s']:.1f} tok/s, reward {r.get('reward_mean', float('nan')):.2f}", flush=True)  # fmt: skip


def time_rollout_phases(trainer: Any, cur: dict[str, Any]) -> None:
    """Wrap the GRPOTrainer's `model.generate` (rollout seconds, calls) and its generate-and-score phase (its
    seconds, completion tokens) so that each step's row can split the step into rollout, scoring and update."""
    generate, phase = trainer.model.generate, trainer._generate_and_score_completions

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            cur["rollout_s"] += time.perf_counter() - t0
            cur["generate_calls"] += 1

    def timed_phase(inputs):
        t0 = time.perf_counter()
        out = phase(inputs)
        cur["phase_s"] += time.perf_counter() - t0
        cur["completion_tokens"] += int(out["completion_mask"].sum())
        return out

    trainer.model.generate = timed_generate
    trainer._generate_and_score_completions = timed_phase


def trl_child(args: argparse.Namespace) -> None:
    """One TRL arm run in this process: per-step rows to --child-out."""
    spec = json.loads(Path(args.spec).read_text())
    threads = spec["threads"]
    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from sparserl.config import load_config
    from sparserl.models import encode_prompt, load_model, prepare_for_training
    from sparserl.tasks import make_task

    t_start = time.perf_counter()
    cfg = load_config(None, spec["overrides"])
    model, tok = load_model(cfg.model.spec, dtype=getattr(torch, cfg.model.weights_dtype))  # master weights
    prepare_for_training(model)  # the GGUF marker would make transformers' Trainer refuse to train it
    task = make_task(cfg.task, "train")
    indices = spec["prompt_indices"]
    messages = [task[i].messages for i in indices]
    trl_ids = tok.apply_chat_template(messages[0], add_generation_prompt=True, tokenize=True, return_dict=True)  # fmt: skip
    same_prompt = list(trl_ids["input_ids"]) == encode_prompt(tok, messages[0])
    data = Dataset.from_dict({"prompt": messages, "index": indices})
    rows: list[dict[str, Any]] = []
    cur: dict[str, Any] = {}

    def builtin_reward(completions, index, **kwargs):
        """sparserl's own reward of the task (Task.score_batch: the same function and fault guard)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [s if math.isfinite(s) else 0.0 for s in task.score_batch(texts, [task[i] for i in index])]
        cur.update(reward_mean=sum(scores) / len(scores), prompt_index=int(index[0]))
        return scores

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            cur.clear()
            cur.update(rollout_s=0.0, phase_s=0.0, completion_tokens=0, generate_calls=0)
            cur.update(_t0=time.perf_counter(), _c0=time.process_time(), torch_threads=torch.get_num_threads())  # fmt: skip

        def on_step_end(self, a, state, control, **kw):
            wall, cpu = time.perf_counter() - cur.pop("_t0"), time.process_time() - cur.pop("_c0")
            phase = cur.pop("phase_s")
            row = step_row(state.global_step, wall, cpu, cur["rollout_s"], phase - cur["rollout_s"], wall - phase,
                           cur["completion_tokens"])  # fmt: skip
            row.update({k: cur[k] for k in ("reward_mean", "prompt_index", "generate_calls", "torch_threads")})  # fmt: skip
            rows.append(row)
            print_step("trl", row)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=builtin_reward,
        args=GRPOConfig(**trl_config_kwargs(cfg, spec["steps"], spec["output_dir"])),
        train_dataset=data,
        processing_class=tok,
        callbacks=[StepTimer()],
    )
    time_rollout_phases(trainer, cur)
    torch.set_num_threads(threads)
    setup_s = time.perf_counter() - t_start
    trainer.train()
    if not rows or any(r["generate_calls"] == 0 for r in rows):
        raise SystemExit("rl_step: TRL never called model.generate: the timing hooks do not fit this TRL version")  # fmt: skip
    out = {"steps": rows, "setup_s": setup_s, "prompt_tokens": len(trl_ids["input_ids"]),
           "same_prompt_ids_as_sparserl": same_prompt}  # fmt: skip
    Path(args.child_out).write_text(json.dumps(out))
