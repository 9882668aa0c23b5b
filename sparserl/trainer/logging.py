"""Where metrics go: a rich progress bar with live reward / length / rejection rate, metrics.jsonl,
TensorBoard, and W&B, MLflow or Trackio when installed and asked for; the completions table
(trainer/completions.py) goes to completions.jsonl and each tracker's table type."""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from torch import Tensor

from sparserl.algo.keep_sampling import kept_set_metrics
from sparserl.algo.masked import masked_mean, token_mask
from sparserl.config import ConfigError, LoggingConfig, flatten
from sparserl.engine.cache import dense_kv_bytes
from sparserl.trainer.completions import COMPLETIONS_FILE, columns, markdown

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


def check_backends(cfg: LoggingConfig) -> None:
    """Fail fast (before loading a model) when W&B, MLflow or Trackio is requested but not installed."""
    for name, wanted in (("wandb", cfg.wandb), ("mlflow", cfg.mlflow), ("trackio", cfg.trackio)):
        if wanted and importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"logging.{name}=true but {name} is not installed: `pip install {name}` or set it false"
            )


def _finite(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)):
            out[k] = float(v)
    return out


class MetricSinks:
    """metrics.jsonl + TensorBoard + optional W&B / MLflow / Trackio, one `log(step, metrics)` for all, and
    `log_completions(step, rows)` for the completions table."""

    def __init__(
        self, run_dir: Path, cfg: LoggingConfig, config: dict[str, Any], resume_step: int = 0
    ) -> None:
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.jsonl_path = self.run_dir / METRICS_FILE if cfg.jsonl else None
        self.completions_path = self.run_dir / COMPLETIONS_FILE if cfg.completions > 0 else None
        for path in (self.jsonl_path, self.completions_path):
            if path is not None:
                _truncate_after(path, resume_step)
        self.tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a killed run wrote after its last checkpoint.
            self.tb = SummaryWriter(
                str(self.run_dir / TB_DIR), purge_step=resume_step + 1 if resume_step else None
            )
        self.wandb = None
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project,
                name=self.run_dir.name,
                dir=str(self.run_dir),
                config=config,
                resume="allow",
            )
        self.mlflow = None
        if cfg.mlflow:
            import mlflow

            mlflow.set_experiment(cfg.mlflow_experiment)
            mlflow.start_run(run_name=self.run_dir.name)
            mlflow.log_params(flatten(config))
            self.mlflow = mlflow
        self.trackio = None
        if cfg.trackio:
            import trackio

            trackio.init(project=cfg.trackio_project, name=self.run_dir.name, config=config, resume="allow")
            self.trackio = trackio

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Send one step's metrics to every enabled sink (non-finite values are kept in JSONL as null)."""
        nums = _finite(metrics)
        if self.jsonl_path is not None:
            row = {"step": step, "time": time.time()}
            row.update({k: (v if math.isfinite(v) else None) for k, v in nums.items()})
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        clean = {k: v for k, v in nums.items() if math.isfinite(v)}
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in clean.items()}, step=step)
        if self.trackio is not None:
            self.trackio.log(clean, step=step)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """One step's completions table (trainer/completions.py): appended to completions.jsonl, and logged
        as a wandb.Table, an MLflow table artifact (completions/step_N.json), a trackio.Table and a Markdown
        table in TensorBoard's text tab."""
        if not rows:
            return
        if self.completions_path is not None:
            with open(self.completions_path, "a") as f:
                f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
        names = columns(rows)
        data = [[row.get(n) for n in names] for row in rows]
        if self.tb is not None:
            self.tb.add_text("completions", markdown(rows), step)
            self.tb.flush()
        if self.wandb is not None:
            import wandb

            table = wandb.Table(columns=names, data=data, allow_mixed_types=True)
            self.wandb.log({"completions": table}, step=step)
        if self.mlflow is not None:
            table = {n: [row.get(n) for row in rows] for n in names}
            self.mlflow.log_table(table, artifact_file=f"completions/step_{step:06d}.json")
        if self.trackio is not None:
            table = self.trackio.Table(columns=names, data=data, allow_mixed_types=True)
            self.trackio.log({"completions": table}, step=step)

    def close(self) -> None:
        """Flush and close every sink."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
        if self.trackio is not None:
            self.trackio.finish()


def _truncate_after(path: Path, step: int) -> None:
    """Keep only rows with step <= `step` (rows a killed run logged after its last checkpoint are redone)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    path.write_text("".join(line + "\n" for line in keep))


class ProgressDisplay:
    """Rich progress bar over training steps with live reward, length and rejection rate, `numbers(metrics)`
    (the active systems' numbers) and the current phase ('evaluating before training', 'step 1: sampling');
    plain lines instead when the console is not a terminal (CI, pipes) so logs stay readable (there the
    phases are said until the first step of the session is done)."""

    def __init__(
        self,
        total: int,
        start: int,
        enabled: bool = True,
        console: Console | None = None,
        numbers: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        self.console = console or Console(stderr=True)
        self.live = enabled and self.console.is_terminal
        self.enabled = enabled
        self.numbers = numbers
        self.stepped = False
        self.progress: Progress | None = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]{task.fields[phase]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total, completed=start, stats="", phase="train")
            self.progress.start()
        self.total = total

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Advance to `step` and show its headline numbers."""
        stats = (
            f"reward {metrics.get('reward/mean', float('nan')):.3f}  "
            f"len {metrics.get('length/mean', float('nan')):.0f}  "
            f"rej {metrics.get('rejection_rate', 0.0):.1%}  "
            f"{metrics.get('time/step', 0.0):.1f}s/step"
        )
        extra = self.numbers(metrics) if self.numbers is not None else ""
        stats += f"  {extra}" if extra else ""
        self.stepped = True
        if self.progress is not None:
            self.progress.update(self.task, completed=step, stats=stats, phase="train")
        elif self.enabled:
            self.console.print(f"step {step}/{self.total}  {stats}", highlight=False)

    def phase(self, text: str, after_steps: bool = False) -> None:
        """Say what the run is doing now (the bar's label; a plain line until the first step is done, or
        `after_steps` also after it)."""
        if self.progress is not None:
            self.progress.update(self.task, phase=text)
        elif self.enabled and (after_steps or not self.stepped):
            self.console.print(f"{text}...", highlight=False)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print above the bar (long paths are not wrapped)."""
        kwargs.setdefault("soft_wrap", True)
        self.console.print(*args, **kwargs)

    def close(self) -> None:
        """Stop the live bar."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    if pct:
        return f"{v:.1%}"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _mib(v: Any) -> str:
    return "n/a" if v is None else f"{v / 2**20:.1f} MiB"


def kv_memory_text(summary: dict[str, Any]) -> str:
    """The summary's KV memory line: the share saved against the dense engine's own allocation for the same
    batches, or "no KV memory saved" when the rollouts' cache held as much or more (dense; block_topk, which
    reads fewer positions but keeps the whole cache)."""
    frac, peak, dense = (
        summary.get(k) for k in ("kv_saved_fraction", "peak_kv_bytes_mean", "dense_kv_bytes_mean")
    )
    if peak is None or dense is None:
        return "n/a"
    sizes = f"({_mib(peak)} vs {_mib(dense)} for the dense engine, per rollout)"
    if not frac or peak >= dense:
        return f"no KV memory saved {sizes}"
    return f"{frac:.1%} {sizes}"


def memory_text(summary: dict[str, Any]) -> str:
    """The summary's peak memory line: this process's, or the sum over the run's processes (Ray rollout
    workers and learner ranks each hold a model copy), each named."""
    peaks = summary.get("peak_rss_bytes_by_process") or {}
    total = summary.get("peak_rss_bytes_all_processes")
    if total is None:
        return "n/a"
    gib = {name: f"{v / 2**30:.2f} GiB" for name, v in {"all": total, **peaks}.items()}
    if len(peaks) <= 1:
        return f"{gib['all']} (this process)"
    each = ", ".join(f"{name} {gib[name]}" for name in peaks)
    return f"{gib['all']} summed over {len(peaks)} processes ({each})"


def render_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print the end-of-run summary as a table: rewards, KV memory, rejection rate, where the logs are."""
    from rich.table import Table

    console = console or Console(stderr=True)
    t = Table(title="sparserl run summary", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(overflow="fold")  # paths are folded, never cut with an ellipsis
    t.add_row("steps", str(summary.get("steps")))
    t.add_row(
        "eval reward before -> after",
        f"{_fmt(summary.get('eval_reward_before'))} -> {_fmt(summary.get('eval_reward_after'))}",
    )
    t.add_row(
        "train reward first -> last step",
        f"{_fmt(summary.get('train_reward_first_step'))} -> {_fmt(summary.get('train_reward_last_step'))}",
    )
    t.add_row("rollouts", str(summary.get("rollouts")))
    t.add_row("KV memory saved (peak, vs the dense engine)", kv_memory_text(summary))
    t.add_row("sequence rejection rate", _fmt(summary.get("rejection_rate_mean"), pct=True))
    t.add_row("skipped non-finite updates", str(summary.get("nonfinite_skipped_updates")))
    t.add_row("seconds per step", _fmt(summary.get("seconds_per_step")))
    t.add_row("peak memory (resident, each process's peak)", memory_text(summary))
    t.add_row("run directory", str(summary.get("run_dir")))
    if summary.get("metrics"):
        t.add_row("metrics (JSONL)", str(summary["metrics"]))
    if summary.get("tensorboard"):
        t.add_row("TensorBoard", f"tensorboard --logdir {summary['tensorboard']}")
    t.add_row("last checkpoint", str(summary.get("checkpoint")))
    t.add_row("trained model", str(summary.get("model")))
    console.print(t)


def is_number(v: Any) -> bool:
    """A real number or a one-element tensor (bools excluded): what a metric value may be."""
    from torch import Tensor

    return (
        isinstance(v, (int, float)) and not isinstance(v, bool) or (isinstance(v, Tensor) and v.numel() == 1)
    )


def kv_saving_metrics(
    stats: dict[str, Any], prompts: list[list[int]], completions: list[list[int]], max_new: int, sparse: bool
) -> dict[str, float]:
    """KV memory of the rollout versus what the dense engine allocates for the same batch (`peak_dense_kv_bytes`,
    which the engine reports from `engine.allocation.dense_kv_allocation`: a group's prompt held once), the
    allocation of a naive per-row cache (every row the longest prompt + max_new, labelled so), and peak
    positions held per sequence versus dense. A cache holding as much as dense or more saves 0."""
    out: dict[str, float] = {}
    dense_peak = max((len(p) + len(c) for p, c in zip(prompts, completions, strict=True)), default=0)
    per_pos, peak_bytes, dense_bytes, peak = (
        stats.get(k)
        for k in ("kv_bytes_per_position", "peak_kv_bytes", "peak_dense_kv_bytes", "peak_kv_positions")
    )
    if peak_bytes and dense_bytes and is_number(peak_bytes) and is_number(dense_bytes):
        out["kv/dense_kv_bytes"] = float(dense_bytes)
        out["kv/saved_fraction"] = max(0.0, 1.0 - float(peak_bytes) / float(dense_bytes)) if sparse else 0.0
    if per_pos and is_number(per_pos) and prompts:
        out["kv/naive_kv_bytes"] = dense_kv_bytes(per_pos, len(prompts), prompts, max_new)
    if peak and is_number(peak) and dense_peak:
        out["kv/dense_peak_positions"] = float(dense_peak)
        out["kv/positions_saved_fraction"] = max(0.0, 1.0 - float(peak) / dense_peak) if sparse else 0.0
    return out


def sample_metrics(samples: list[Any], advantages: Tensor) -> dict[str, float]:
    """Reward, length and advantage statistics of the step's samples (rollout.records.SampleRecord), and
    `rollout/entropy_estimate`: the mean of -log p_sampler over the sampled tokens, an unbiased estimate of the
    sampler's per-token entropy (the distribution drawn from: temperature, top-p/k and sparse KV applied) that
    costs nothing, for watching entropy collapse without an entropy term in the loss."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    logps = [lp for s in samples for lp in s.sampler_logps]
    lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.float32)
    truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.float32)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "reward/max": rewards.max().item(),
        "length/mean": lengths.mean().item(),
        "length/max": lengths.max().item(),
        "length/truncated_frac": truncated.mean().item(),
        "adv/abs_mean": masked_mean(advantages.abs(), token_mask(advantages, lengths.long().tolist())).item(),
        "rollout/entropy_estimate": -sum(logps) / len(logps) if logps else 0.0,
    }


def rollout_metrics(
    cfg: Any, got: Any, samples: list[Any], batch: Any, penalty: Tensor, planned: dict[str, float]
) -> dict[str, float]:
    """A step's rollout metrics after the acceptance ones: the samples' (`sample_metrics`), the sampling rounds'
    (`sampling/*`), the source's, transforms' and timings' (`planned`), DAPO's overlong penalty, the engine's
    statistics (`rollout/*`), the KV memory saved, what the reward functions logged, the kept sets'."""
    stats = got.metrics
    out = sample_metrics(samples, batch.advantages)
    out.update({f"sampling/{k}": v for k, v in got.sampling.items()})
    out.update(planned)
    if cfg.algo.overlong_buffer:
        out["reward/overlong_penalty"] = float(penalty.mean())
    out.update({f"rollout/{k}": float(v) for k, v in stats.items() if is_number(v)})
    out.update(
        kv_saving_metrics(stats, batch.prompts, batch.completions, cfg.rollout.max_new_tokens, cfg.sparse)
    )
    out.update(got.logged)  # what the reward functions logged (log_metric)
    out.update(kept_set_metrics(batch.kept, batch.mask) if batch.kept is not None else {})
    return out
