"""Helpers shared by the sparse-path experiments (study_v2, distill_sparse): parts written once and read back,
the calibration prompts, the positions a schedule reads, and rollout throughput per schedule."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from study import ROOT, write_with_goals

CONFIG = ROOT / "configs" / "default.yaml"
KV = {"page_size": 16, "dense_layers": [0, 1]}  # block_topk as the sparse-path experiments run it
CAL_OFFSET, CAL_PROMPTS = 5000, 16  # calibration prompts: test-split rows far from the held-out ones


def calibration_prompts(task, tokenizer) -> list[list[int]]:
    """The calibration prompts, encoded: CAL_PROMPTS test rows from CAL_OFFSET on (both studies calibrate on them)."""
    from sparserl.models import encode_prompt

    return [encode_prompt(tokenizer, task[CAL_OFFSET + i].messages) for i in range(CAL_PROMPTS)]


def read_part(path: Path) -> dict:
    """A part's results, without the goals mapping the report stamps on every file."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "goals"}


def read_part_if_done(path: Path, missing: Any = None) -> Any:
    """`read_part(path)`, or `missing` where that part has not run yet."""
    return read_part(path) if path.is_file() else missing


def cached(path: Path, make, goals: dict | None = None) -> dict:
    """`make()` written to `path` once with the `goals` mapping on top (a part's: judged elsewhere; a report may
    stamp it again), through a temporary file so a killed run leaves no half-written part; later runs read it
    back."""
    if path.is_file():
        return read_part(path)
    t0 = time.perf_counter()
    out = make()
    out["seconds"] = time.perf_counter() - t0
    write_with_goals(path, out, goals or {})
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"wrote {shown} ({out['seconds']:.0f} s)", flush=True)
    return out


def positions_read(schedule: list[list[int]], table: list[dict]) -> float:
    """Mean positions a sparse layer reads per decode step under `schedule`, over the calibration's tokens
    (per bin: its token count, its mid length, min(budget, length))."""
    bins = table[0]["bins"]
    starts = [s for s, _ in schedule]
    total = read = 0.0
    for b in bins:
        mid = (b["start"] + b["end"]) / 2
        budget = schedule[max(i for i, s in enumerate(starts) if s <= mid)][1]
        total += b["tokens"]
        read += b["tokens"] * min(budget, mid)
    return read / total if total else float("nan")


def throughput(
    schedules: dict[str, list[list[int]] | None],
    prompts: list[list[int]],
    repeats: int,
    model_spec: str = "smollm2-135m",
    kv_options: dict | None = None,
    max_new_tokens: int = 64,
) -> dict:
    """Rollout tokens per CPU second of each block_topk schedule (None: dense) on `model_spec`: `prompts` x 8
    samples x `max_new_tokens` (eos ignored, so every arm generates the same tokens' worth), arms alternated."""
    from sparserl.engine import KVConfig, RolloutEngine
    from sparserl.models import load_model

    model, tok = load_model(model_spec)
    engines = {}
    for name, sched in schedules.items():
        kv = None if sched is None else KVConfig(method="block_topk", schedule=sched, **(kv_options or KV))
        engines[name] = RolloutEngine(model, tok, kv)
        engines[name].eos_ids = set()
    cpu: dict[str, list[float]] = {name: [] for name in schedules}
    tokens = len(prompts) * 8 * max_new_tokens
    for _ in range(repeats):
        for name, engine in engines.items():
            c0 = time.process_time()
            engine.generate(prompts, n=8, max_new_tokens=max_new_tokens, seed=0)
            cpu[name].append(time.process_time() - c0)
    return {name: {"cpu_s": v, "tokens_per_cpu_s": tokens / statistics.median(v)} for name, v in cpu.items()}
