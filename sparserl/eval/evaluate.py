"""Evaluation under dense and sparse inference: the same prompts, sampled with the same seeds on a dense KV
cache and on a sparse one (evicting or block-sparse), scored by the task's verifiable reward. Reports mean@k, pass@k (unbiased),
completion length, truncated share and KV memory for each, and the sparse-minus-dense differences."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.context_length import split_by_fit, too_long_message
from sparserl.engine.scored import generate_and_score
from sparserl.errors import DataError, UserError
from sparserl.eval.metrics import summarize_rewards
from sparserl.tasks import Example, Task
from sparserl.tasks.rewards import math_reward

# Sampling of the Sparse-RL paper's evaluation.
EVAL_TEMPERATURE = 0.8
EVAL_TOP_P = 0.95

ProgressFn = Callable[[str, int, int], None]  # (mode, prompts done, prompts total)


class ExamplesTask(Task):
    """A plain list of Examples scored by math-verify equivalence with `example.answer`."""

    name = "examples"
    self_guarded = True  # math_reward bounds its own time (killable worker)

    def __init__(self, examples: Sequence[Example], timeout: float = 5.0) -> None:
        self.examples = list(examples)
        self.reward_timeout = timeout

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def reward(self, completion_text: str, example: Example) -> float:
        """1.0 when the extracted \\boxed{} / #### answer equals the reference, else 0.0."""
        return math_reward(completion_text, example.answer, 0.0, self.reward_timeout)


def chunk_seed(seed: int, start: int) -> int:
    """Sampling seed of the prompt chunk beginning at `start` (the same for dense and sparse inference)."""
    return int(np.random.SeedSequence([abs(int(seed)), int(start)]).generate_state(1)[0] & 0x7FFFFFFF)


def check_prompt_lengths(
    model: torch.nn.Module, task: Task, indices: list[int], prompt_ids: list[list[int]], max_new_tokens: int
) -> None:
    """Every prompt leaves room for `max_new_tokens` in the model's context; otherwise a DataError naming
    the rows (file:line), before any sampling rather than midway through the evaluation."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not limit:
        return
    if max_new_tokens >= limit:
        raise UserError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's {limit} positions"
        )
    _, long = split_by_fit(indices, lambda i: len(prompt_ids[i]), max_new_tokens, limit)
    if long:

        def where(i: int) -> str:
            return str(task[i].meta.get("source") or f"prompt {i}")

        raise DataError(
            f"{too_long_message(long, where, max_new_tokens, limit, 'max_new_tokens')}; lower max_new_tokens "
            "or drop those rows"
        )


def _run_mode(
    engine: RolloutEngine,
    task: Task,
    indices: list[int],
    prompt_ids: list[list[int]],
    samples: int,
    gen_kwargs: dict[str, Any],
    seed: int,
    batch_prompts: int,
    progress: ProgressFn | None,
    mode: str,
) -> dict[str, Any]:
    """Sample and score every prompt with one engine; per-prompt rewards/lengths plus aggregated KV stats."""
    tok = engine.tokenizer
    rewards: list[list[float]] = []
    lengths: list[list[int]] = []
    finishes: list[list[str]] = []
    texts: list[list[str]] = []
    agg = {"peak_kv_bytes": 0.0, "peak_kv_positions": 0.0, "compression_events": 0.0}
    retained, generated, gen_s, reward_s, bytes_per_pos = 0.0, 0, 0.0, 0.0, 0.0
    dense_bytes = 0.0
    stats_before = dict(task.stats.as_metrics())

    def score_each(texts: list[str], examples: list[Example]) -> list[float]:
        return [task.score(text, example) for text, example in zip(texts, examples, strict=True)]

    for start in range(0, len(indices), batch_prompts):
        chunk = list(range(start, min(start + batch_prompts, len(indices))))
        ids = [prompt_ids[i] for i in chunk]
        rows = [indices[i] for i in chunk]
        scored = generate_and_score(
            engine, tok, task, rows, ids, gen_kwargs, chunk_seed(seed, start), score_each, samples
        )
        st = scored.stats
        agg["peak_kv_bytes"] = max(agg["peak_kv_bytes"], float(st["peak_kv_bytes"]))
        agg["peak_kv_positions"] = max(agg["peak_kv_positions"], float(st["peak_kv_positions"]))
        agg["compression_events"] += float(st["compression_events"])
        bytes_per_pos = float(st["kv_bytes_per_position"])
        dense_bytes = max(dense_bytes, float(st["peak_dense_kv_bytes"]))  # the dense engine's own allocation
        gen_s += float(st["prefill_s"]) + float(st["decode_s"])
        generated += int(st["generated_tokens"])
        by_prompt: dict[int, list[int]] = {}
        for j, s in enumerate(scored.samples):
            by_prompt.setdefault(s.prompt_index, []).append(j)
            retained += float(s.stats.get("retained_fraction", 1.0))
        for local in range(len(chunk)):
            group = by_prompt[local]
            rewards.append([scored.rewards[j] for j in group])
            lengths.append([scored.lengths[j] for j in group])
            finishes.append([scored.samples[j].finish_reason for j in group])
            texts.append([scored.texts[j] for j in group])
        reward_s += scored.score_s
        if progress is not None:
            progress(mode, chunk[-1] + 1, len(indices))
    totals = {"dense_bytes": dense_bytes, "bytes_per_pos": bytes_per_pos, "retained": retained,
              "generated": generated, "gen_s": gen_s, "reward_s": reward_s}  # fmt: skip
    section = _summary(rewards, lengths, finishes, agg, totals)
    stats_after = task.stats.as_metrics()
    for key in ("reward/errors", "reward/timeouts"):
        section[key.replace("/", "_")] = int(stats_after.get(key, 0) - stats_before.get(key, 0))
    section["_per_prompt"] = {"rewards": rewards, "lengths": lengths, "finish": finishes, "texts": texts}
    return section


def _summary(
    rewards: list[list[float]], lengths: list[list[int]], finishes: list[list[str]], agg: dict, totals: dict
) -> dict[str, Any]:
    """One mode's section: reward summary, lengths, truncation, KV memory and saving, throughput."""
    n_samples = sum(len(x) for x in lengths)
    flat_len = [x for row in lengths for x in row]
    flat_fin = [x for row in finishes for x in row]
    dense_bytes, gen_s = totals["dense_bytes"], totals["gen_s"]
    section: dict[str, Any] = summarize_rewards(rewards)
    section.update(
        {
            "mean_length": sum(flat_len) / n_samples,
            "max_length": max(flat_len),
            "truncated_share": flat_fin.count("length") / n_samples,
            "peak_kv_bytes": agg["peak_kv_bytes"],
            "dense_kv_bytes": dense_bytes,
            "kv_saved_fraction": max(0.0, 1.0 - agg["peak_kv_bytes"] / dense_bytes) if dense_bytes else 0.0,
            "peak_kv_positions": agg["peak_kv_positions"],
            "kv_bytes_per_position": totals["bytes_per_pos"],
            "retained_fraction": totals["retained"] / n_samples,
            "compression_events": agg["compression_events"],
            "generated_tokens": totals["generated"],
            "tokens_per_s": totals["generated"] / gen_s if gen_s > 0 else 0.0,
            "generate_s": gen_s,
            "reward_s": totals["reward_s"],
        }
    )
    return section


def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task | Sequence[Example],
    kv: KVConfig | None = None,
    samples: int = 4,
    limit: int | None = None,
    max_new_tokens: int = 1024,
    temperature: float = EVAL_TEMPERATURE,
    top_p: float = EVAL_TOP_P,
    top_k: int = 0,
    seed: int = 0,
    batch_prompts: int = 8,
    stop: Sequence[str] | None = None,
    dense: bool = True,
    details: bool = False,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """mean@k and pass@k (k = `samples`) of `model` on the first `limit` prompts of `task` (a Task, or a list
    of Examples scored by math-verify), under dense inference (`dense=True`) and, when `kv` is a sparse
    method, under sparse inference with that KV policy. Both modes use the same prompts and, per chunk of
    `batch_prompts` prompts, the same sampling seed, so they differ only by the cache. Returns a JSON-ready
    dict: {'dense': {...}, 'sparse': {...}, 'sparse_minus_dense': {...}, ...}; with `details`, also the
    per-prompt rewards, lengths, finish reasons and completion texts under 'examples'."""
    from sparserl.models import encode_prompt

    if not isinstance(task, Task):
        task = ExamplesTask(task)
    if samples < 1:
        raise ValueError(f"samples={samples} must be >= 1")
    if batch_prompts < 1:
        raise ValueError(f"batch_prompts={batch_prompts} must be >= 1")
    count = len(task) if not limit else min(limit, len(task))
    if count < 1:
        raise ValueError(f"task {getattr(task, 'name', '')!r} has no prompts to evaluate")
    sparse = kv is not None and kv.sparse
    if not dense and not sparse:
        raise ValueError("nothing to evaluate: dense=False and kv is not a sparse method")
    indices = list(range(count))
    prompt_ids = [encode_prompt(tokenizer, task[i].messages) for i in indices]
    check_prompt_lengths(model, task, indices, prompt_ids, max_new_tokens)
    gen_kwargs = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "stop": list(stop) if stop else None,
    }
    result: dict[str, Any] = {
        "task": getattr(task, "name", type(task).__name__),
        "prompts": count,
        "samples": samples,
        "seed": seed,
        "batch_prompts": batch_prompts,
        "sampling": {k: v for k, v in gen_kwargs.items() if k != "stop"} | {"stop": list(stop or [])},
        "kv": (
            {k: getattr(kv, k) for k in ("method", "budget", "window", "interval", "granularity", "quant")}
            | {"described": kv.describe()}
            if sparse
            else None
        ),
        "mean_prompt_tokens": sum(len(p) for p in prompt_ids) / count,
    }
    modes: list[tuple[str, KVConfig | None]] = ([("dense", None)] if dense else []) + (
        [("sparse", kv)] if sparse else []
    )
    for mode, mode_kv in modes:
        engine = RolloutEngine(model, tokenizer, mode_kv)
        result[mode] = _run_mode(
            engine, task, indices, prompt_ids, samples, gen_kwargs, seed, batch_prompts, progress, mode
        )
    if "dense" in result and "sparse" in result:
        result["sparse_minus_dense"] = _sparse_minus_dense(result["dense"], result["sparse"])
    per = {mode: result[mode].pop("_per_prompt") for mode, _ in modes}
    if details:
        result["examples"] = _examples(task, indices, per)
    return result


def _sparse_minus_dense(d: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """Sparse minus dense for every mean@/pass@, the mean length and truncation; the ratio of peak KV bytes."""
    keys = [k for k in d if k.startswith(("mean@", "pass@"))] + ["mean_length", "truncated_share"]
    out: dict[str, Any] = {k: s[k] - d[k] for k in keys}
    out["kv_bytes_ratio"] = s["peak_kv_bytes"] / d["peak_kv_bytes"] if d["peak_kv_bytes"] else None
    return out


def _examples(task: Task, indices: list[int], per: dict[str, dict[str, list]]) -> list[dict[str, Any]]:
    """Per prompt: its answer and source, and per mode its rewards, lengths, finish reasons and completions."""
    return [
        {
            "index": i,
            "answer": task[i].answer,
            "source": task[i].meta.get("source", ""),
            **{
                mode: {
                    "rewards": per[mode]["rewards"][j],
                    "lengths": per[mode]["lengths"][j],
                    "finish": per[mode]["finish"][j],
                    "completions": per[mode]["texts"][j],
                }
                for mode in per
            },
        }
        for j, i in enumerate(indices)
    ]


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    """Write the report (creating the parent directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
