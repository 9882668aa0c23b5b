"""`sparserl bias`: K coupled batches (sparserl/eval/bias_run.py), each saved as it ends (--resume takes the saved
ones), then the report (sparserl/eval/bias_stats.py): rollout statistics with prompt-clustered intervals, each
estimator's gradient against the dense one with batch-bootstrap intervals, a verdict per estimator, a JSON and a
plot (docs/bias.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from sparserl.algo.keep_sampling import truncates
from sparserl.config import TrainConfig
from sparserl.errors import UserError
from sparserl.eval.bias import DENSE, NAIVE, estimator_configs, rollout_clusters
from sparserl.eval.bias_run import BiasRun, make_sketch
from sparserl.eval.bias_stats import (
    bootstrap_counts,
    cluster_table,
    gradient_report,
    ratio_of_sums,
    verdict,
)

SETTINGS_FILE, REPORT_FILE, PLOT_FILE, BATCHES_DIR = "settings.json", "bias.json", "bias.png", "batches"
COMPLEMENTS = ("kv_saving_mean_held",)  # reported as 1 - sum(sparse) / sum(dense)


@dataclasses.dataclass
class BiasSettings:
    """What `sparserl bias` measures, besides the config (flags of the command; docs/bias.md)."""

    prompts: int = 4  # prompts per batch (each with rollout.n coupled samples)
    batches: int = 4  # K
    estimators: list[str] = dataclasses.field(default_factory=lambda: ["config", "seq-is"])  # besides naive
    gradients: bool = True
    micro_batch: int = 8
    sketch_dim: int | None = None  # None: exact up to 8M parameters, else a CountSketch of 2^20
    draws: int = 2000
    matter: float = 0.10
    inert: float = 0.05


def _check_out(out: Path, fingerprint: dict, resume: bool) -> None:
    """A new --out, or with --resume one whose saved settings equal these but for --batches, which may grow (the
    saved batches are kept and the new ones measured; else a clear error). A setting the saved file lacks (one
    added to sparserl since) counts at its default, so an upgrade alone does not stop a resume."""
    saved = out / SETTINGS_FILE
    if saved.is_file() and not resume:
        raise UserError(
            f"--out {out} already holds a bias measurement: pass --resume to continue it, or another --out"
        )
    if not saved.is_file() and resume and out.exists() and any(out.iterdir()):
        raise UserError(f"--resume: {out} holds no {SETTINGS_FILE}; it is not a sparserl bias folder")
    if saved.is_file():
        old = _with_defaults(json.loads(saved.read_text()), _fingerprint(TrainConfig(), BiasSettings()))
        changed = [d for d in _differences(old, fingerprint) if d != "settings.batches"]
        if changed:
            raise UserError(
                f"--resume: {out} was measured with other settings ({', '.join(changed[:6])}); use another --out"
            )
        if old["settings"]["batches"] > fingerprint["settings"]["batches"]:
            raise UserError(
                f"--resume: {out} was measured with --batches {old['settings']['batches']}; pass at least that many"
            )
    out.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_suffix(f".{os.getpid()}.tmp")  # written whole: the processes of a split read it at once
    tmp.write_text(json.dumps(fingerprint, indent=1))
    tmp.replace(saved)


def _fingerprint(cfg: TrainConfig, s: BiasSettings) -> dict:
    return json.loads(json.dumps({"config": cfg.to_dict(), "settings": dataclasses.asdict(s)}))


def _with_defaults(saved: Any, defaults: Any) -> Any:
    """`saved` with the keys it lacks taken from `defaults` (nested dicts merged)."""
    if not (isinstance(saved, dict) and isinstance(defaults, dict)):
        return saved
    return {k: _with_defaults(saved[k], defaults.get(k)) if k in saved else defaults[k]
            for k in set(saved) | set(defaults)}  # fmt: skip


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def _rows(run: BiasRun, want: int) -> list[int]:
    """The task's first `want` rows that fit the model with rollout.max_new_tokens (as training checks them)."""
    from sparserl.trainer.data import usable_rows

    cfg = run.cfg
    rows, _ = usable_rows(run.view.task, lambda i: len(run.view.prompt_ids(i)), run.sampler.decoder.max_positions,
                          cfg.rollout.max_new_tokens, cfg.task.on_long_prompt, want)  # fmt: skip
    if len(rows) < want:
        raise UserError(
            f"sparserl bias: --prompts x --batches = {want} prompts, but the task has {len(rows)} usable rows; "
            "lower --batches or --prompts"
        )
    return rows


def batch_path(out: str | Path, k: int) -> Path:
    """Where batch k (0-based) of the measurement in `out` is saved (what --resume and --part read)."""
    return Path(out) / BATCHES_DIR / f"{k:04d}.pt"


def part_batches(batches: int, part: tuple[int, int] | None) -> range:
    """The batch indices of part (i, n), 1-based: the i-th of n contiguous shares of the K batches (all of them
    for None)."""
    if part is None:
        return range(batches)
    i, n = part
    return range((i - 1) * batches // n, i * batches // n)


def measure(cfg: TrainConfig, s: BiasSettings, out: str | Path, resume: bool = False, progress: Any = None,
            model_loader: Any = None, task: Any = None, command: str = "",
            part: tuple[int, int] | None = None) -> dict | None:  # fmt: skip
    """Run (or finish) the K batches into `out`, then write and return the report. `progress(done, total)` is
    called after each batch. With `part` only that share of the batches is measured and nothing is reported (one
    measurement split over processes or machines sharing `out`; a later call without it writes the report): a
    batch depends only on its index (its prompts and seed), so the split changes no number."""
    if truncates(cfg.rollout.top_p, cfg.rollout.top_k):
        raise UserError(
            f"sparserl bias: rollout.top_p={cfg.rollout.top_p}, rollout.top_k={cfg.rollout.top_k}: the command "
            "scores pi_old with the full softmax and has no keep-sampling mask yet; measure with top_p=1, top_k=0"
        )
    out = Path(out)
    _check_out(out, _fingerprint(cfg, s), resume or part is not None)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    run = BiasRun(cfg, model_loader, task)
    rows = _rows(run, s.prompts * s.batches)
    estimators = estimator_configs(cfg.algo, s.estimators)
    sketch = make_sketch(run.size, s.sketch_dim, cfg.trainer.seed) if s.gradients else None
    (out / BATCHES_DIR).mkdir(exist_ok=True)
    from sparserl.rollout import step_seed

    indices = part_batches(s.batches, part)
    for done, k in enumerate(indices, 1):
        path = batch_path(out, k)
        if not path.is_file():
            t0 = time.process_time()
            c = run.sample(rows[k * s.prompts : (k + 1) * s.prompts], step_seed(cfg.trainer.seed, k))
            record = {
                "clusters": rollout_clusters(c, cfg.rollout.n, estimators),
                "peak_kv_bytes": c.peak_kv_bytes,
                "alpha": c.alpha,
            }
            if s.gradients:
                record["grads"] = run.gradients(c, estimators, s.micro_batch, sketch)
            record["cpu_s"] = time.process_time() - t0
            tmp = path.with_suffix(".tmp")
            torch.save(record, tmp)
            tmp.replace(path)
        if progress is not None:
            progress(done, len(indices))
    if part is not None:
        return None
    reduction = "exact" if sketch is None else f"count-sketch to {sketch.dim} buckets"
    report = summarize(out, s, cfg.trainer.seed, list(estimators), run.size, reduction)
    report = {"goals": {}, "command": command, "sampler": sampler_text(cfg), **report}
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / PLOT_FILE)
    return report


def sampler_text(cfg: TrainConfig) -> str:
    """The sampler under test in words, against its dense twin."""
    r = cfg.rollout
    kv = cfg.kv
    cache = "dense cache" if not cfg.sparse or kv.method == "dense" else f"{kv.method} budget {kv.budget}"
    cache += f", {kv.quant} keys and values" if cfg.sparse and kv.quantized else ""
    temp = f", sampler temperature {r.sampling_temperature}" if r.sampler_temperature is not None else ""
    return f"{cache}{temp}; dense twin at temperature {r.temperature}; corrections of algo.preset={cfg.algo.preset}"


def summarize(
    out: Path, s: BiasSettings, seed: int, estimators: list[str], size: int, reduction: str
) -> dict:
    """The report from the saved batches: rollout statistics, gradient statistics, verdicts, CPU seconds."""
    records = [torch.load(p, weights_only=False) for p in sorted((out / BATCHES_DIR).glob("*.pt"))]
    clusters = [c for r in records for c in r["clusters"]]
    table = cluster_table(clusters)
    counts = bootstrap_counts(len(clusters), s.draws, seed)
    rollout = {k: ratio_of_sums(num, den, counts, k in COMPLEMENTS) for k, (num, den) in table.items()}
    peaks = torch.tensor([r["peak_kv_bytes"] for r in records], dtype=torch.float64)
    rollout["kv_saving_peak"] = ratio_of_sums(peaks[:, 0], peaks[:, 1], bootstrap_counts(len(records), s.draws,
                                              seed), complement=True)  # fmt: skip
    alpha = alpha_p5([r.get("alpha") for r in records])
    if alpha is not None:
        rollout["alpha_p5_topk"] = alpha
    report: dict[str, Any] = {"batches_done": len(records), "batches": s.batches, "complete": len(records) == s.batches,
                              "prompts": len(clusters), "rollout": rollout, "trainable_parameters": size,
                              "gradient_reduction": reduction if s.gradients else None,
                              "cpu_s": {"total": sum(r["cpu_s"] for r in records),
                                        "per_batch": [r["cpu_s"] for r in records]}}  # fmt: skip
    if s.gradients and len(records) >= 2:
        vectors = {name: torch.stack([r["grads"][name] for r in records]) for name in [*estimators, DENSE]}
        grads = gradient_report(vectors, NAIVE, DENSE, s.draws, seed)
        for name, g in grads.items():
            if name != NAIVE:
                g["verdict"] = verdict(g["gamma"], g["cosine_gain"], s.matter, s.inert)
        report["estimators"] = grads
    return report


def alpha_p5(parts: list) -> dict | None:
    """P5 of alpha's top-k bound over every token of the batches, with its sequence-level bootstrap 90% interval
    (block-sparse samplers; None for others)."""
    from sparserl.algo.acceptance import bootstrap_quantile_interval

    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    values = torch.cat([a for a, _ in parts])
    offsets = torch.tensor([0] + [int(s.max()) + 1 for _, s in parts[:-1]]).cumsum(0)
    sequences = torch.cat([s + o for (_, s), o in zip(parts, offsets, strict=True)])
    low, high = bootstrap_quantile_interval(values, sequences, 0.05)
    return {"value": float(torch.quantile(values.double(), 0.05)), "low": low, "high": high}


def plot(report: dict, path: Path) -> None:
    """Cosine to the dense gradient, relative bias and Gamma per estimator, with their intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grads = report.get("estimators")
    if not grads:
        return
    names = list(grads)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, stat, title in zip(axes, ("cosine", "relative_bias", "gamma"),
                               ("cosine c_X to E g_dense", "relative bias B_X", "Gamma_X (vs naive)"), strict=True):  # fmt: skip
        for i, name in enumerate(names):
            v = grads[name].get(stat)
            if v is None or v["value"] is None:
                continue
            if v["low"] is not None:  # a percentile interval need not contain the point estimate
                ax.vlines(i, v["low"], v["high"], color=f"C{i}")
            ax.plot([i], [v["value"]], "o", color=f"C{i}")
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.suptitle(report.get("sampler", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
