"""The run's running totals (kept in the checkpoint's history, so a resume keeps them) and the end-of-run
summary built from them."""

from __future__ import annotations

import math
from typing import Any

from sparserl.process_memory import peak_rss_bytes
from sparserl.trainer.checkpoint import latest_checkpoint
from sparserl.trainer.console import kv_text
from sparserl.trainer.logging import METRICS_FILE, TB_DIR, is_number

# Step metrics whose run means the summary reports.
AVERAGED = ("rejection_rate", "kv/saved_fraction", "rollout/peak_kv_bytes", "kv/dense_kv_bytes", "time/step")


def accumulate(history: dict[str, Any], metrics: dict[str, float]) -> None:
    """Add one step's metrics to the running totals in `history` (first and last reward, sums and counts)."""
    history.setdefault("first_reward", metrics.get("reward/mean"))
    history["last_reward"] = metrics.get("reward/mean")
    history["steps_seen"] = history.get("steps_seen", 0) + 1
    for key in AVERAGED:
        if key in metrics and is_number(metrics[key]) and math.isfinite(metrics[key]):
            history[f"sum:{key}"] = history.get(f"sum:{key}", 0.0) + metrics[key]
            history[f"n:{key}"] = history.get(f"n:{key}", 0) + 1


def run_mean(history: dict[str, Any], key: str) -> float | None:
    """The mean of a metric over the steps that logged it, or None."""
    n = history.get(f"n:{key}", 0)
    return history[f"sum:{key}"] / n if n else None


def process_peaks(trainer: Any) -> dict[str, Any]:
    """The peak resident memory of each of the run's processes (this one, its rollout workers and learner
    ranks) and their sum: an upper bound of what they held together (peaks need not coincide; pages shared
    through Ray's object store count in each process that read them)."""
    peaks = {
        "trainer": peak_rss_bytes(),
        **trainer.rollouts.backend.process_peaks(),
        **trainer.learner.process_peaks(),
    }
    return {"peak_rss_bytes_by_process": peaks, "peak_rss_bytes_all_processes": sum(peaks.values())}


def run_summary(trainer: Any, wall_s: float) -> dict[str, Any]:
    """End-of-run numbers of a `Trainer`: reward before/after, KV saved, rejection rate, where everything is."""
    h, cfg, run_dir = trainer.state.history, trainer.cfg, trainer.run_dir
    ckpt = latest_checkpoint(run_dir)
    return {
        "steps": trainer.state.step,
        "eval_reward_before": h.get("eval_before"),
        "eval_reward_after": h.get("eval_after"),
        "eval_sparse_reward_before": h.get("eval_sparse_before"),
        "eval_sparse_reward_after": h.get("eval_sparse_after"),
        "train_reward_first_step": h.get("first_reward"),
        "train_reward_last_step": h.get("last_reward"),
        "rollouts": kv_text(cfg),
        "kv_saved_fraction": run_mean(h, "kv/saved_fraction"),
        "peak_kv_bytes_mean": run_mean(h, "rollout/peak_kv_bytes"),
        "dense_kv_bytes_mean": run_mean(h, "kv/dense_kv_bytes"),
        "rejection_rate_mean": run_mean(h, "rejection_rate"),
        "nonfinite_skipped_updates": trainer.state.counters.get("train/nonfinite_skips", 0),
        "seconds_per_step": run_mean(h, "time/step"),
        "wall_s_this_session": wall_s,
        "peak_rss_bytes": peak_rss_bytes(),
        **process_peaks(trainer),
        "run_dir": str(run_dir),
        "metrics": str(run_dir / METRICS_FILE) if cfg.logging.jsonl else None,
        "tensorboard": str(run_dir / TB_DIR) if cfg.logging.tensorboard else None,
        "checkpoint": str(ckpt) if ckpt else None,
        "model": h.get("export"),
    }
