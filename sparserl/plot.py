"""`sparserl plot RUN_DIR [RUN_DIR ...]`: a run's metrics.jsonl drawn to PNG (reward, completion length,
dense/sparse mismatch, rejection, KV memory, optimizer), several runs overlaid for a dense-vs-sparse study.

Only metrics present in the logs are drawn; a panel or figure with nothing to show is skipped with a note."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"  # sparserl.trainer.logging.METRICS_FILE
PLOTS_DIR = "plots"
MIB = 2**20


@dataclass
class Panel:
    """One subplot: the metrics it overlays, as (key, label, scale) with values multiplied by `scale`."""

    title: str
    series: list[tuple[str, str]]
    ylabel: str = ""
    scale: float = 1.0
    logy: bool = False
    markers: bool = False  # sparse points (eval rows) drawn as markers


@dataclass
class Figure:
    """One PNG: a grid of panels."""

    name: str
    title: str
    panels: list[Panel] = field(default_factory=list)


_REJECT = "rollout_corr/"
FIGURES: list[Figure] = [
    Figure(
        "reward",
        "Reward",
        [
            Panel("train reward (mean over rollouts)", [("reward/mean", "mean"), ("reward/max", "max")]),
            Panel("reward std within the batch", [("reward/std", "std")]),
            Panel(
                "held-out eval reward",
                [("eval/dense/reward", "dense cache"), ("eval/sparse/reward", "sparse cache")],
                markers=True,
            ),
        ],
    ),
    Figure(
        "length",
        "Completion length",
        [
            Panel("completion length (tokens)", [("length/mean", "mean"), ("length/max", "max")], "tokens"),
            Panel("truncated share (hit max_new_tokens)", [("length/truncated_frac", "truncated")]),
            Panel(
                "held-out eval length",
                [("eval/dense/length", "dense cache"), ("eval/sparse/length", "sparse cache")],
                "tokens",
                markers=True,
            ),
        ],
    ),
    Figure(
        "mismatch",
        "Sampler / dense-policy mismatch (xi = pi_old / pi_sparse)",
        [
            Panel("mismatch KL", [(_REJECT + "kl", "k1 kl"), (_REJECT + "k3_kl", "k3 kl")]),
            Panel(
                "chi-square",
                [(_REJECT + "chi2_token", "token"), (_REJECT + "chi2_seq", "sequence")],
                logy=True,
            ),
            Panel(
                "perplexity gap",
                [(_REJECT + "log_ppl_abs_diff", "|log ppl ratio|"), (_REJECT + "ppl_ratio", "ppl ratio")],
            ),
            Panel("importance ratio", [(_REJECT + "ess", "ESS"), (_REJECT + "xi_mean", "mean xi")]),
        ],
    ),
    Figure(
        "rejection",
        "Rejection and masking",
        [
            Panel(
                "sequence rejection rate",
                [("rejection_rate", "rejected"), (_REJECT + "veto_fraction", "vetoed")],
            ),
            Panel(
                "sequence rules",
                [
                    (_REJECT + "seq_mis_rejected_fraction", "Seq-MIS"),
                    (_REJECT + "geo_rs_rejected_fraction", "Geo-RS"),
                    (_REJECT + "k3_rs_rejected_fraction", "K3-RS"),
                ],
            ),
            Panel(
                "token masks",
                [
                    (_REJECT + "catastrophic_token_fraction", "catastrophic (xi < veto)"),
                    (_REJECT + "token_rs_masked_fraction_low", "token RS low"),
                    (_REJECT + "token_rs_masked_fraction_high", "token RS high"),
                    (_REJECT + "icepop_masked_fraction_low", "IcePop low"),
                    (_REJECT + "icepop_masked_fraction_high", "IcePop high"),
                    (_REJECT + "tis_truncated_fraction", "TIS truncated"),
                ],
            ),
            Panel("tokens kept for the loss", [(_REJECT + "token_keep_fraction", "kept")]),
        ],
    ),
    Figure(
        "kv",
        "KV cache of the rollouts",
        [
            Panel(
                "KV memory saved vs dense",
                [("kv/saved_fraction", "bytes"), ("kv/positions_saved_fraction", "positions")],
            ),
            Panel("retained fraction of the context", [("rollout/retained_fraction", "retained")]),
            Panel(
                "peak KV memory",
                [("rollout/peak_kv_bytes", "sampler"), ("kv/dense_kv_bytes", "dense equivalent")],
                "MiB",
                scale=1 / MIB,
            ),
            Panel("rollout throughput", [("rollout/tokens_per_s", "tokens/s")], "tokens/s"),
        ],
    ),
    Figure(
        "optim",
        "Optimizer",
        [
            Panel("loss", [("actor/loss", "loss"), ("actor/pg_loss", "pg loss")]),
            Panel("PPO clip fraction", [("actor/pg_clipfrac", "clipfrac")]),
            Panel("gradient norm", [("actor/grad_norm", "grad norm")]),
            Panel("KL to reference / entropy", [("actor/kl_ref", "kl ref"), ("actor/entropy", "entropy")]),
        ],
    ),
]
OVERVIEW = Figure(
    "overview",
    "Overview",
    [
        Panel("reward", [("reward/mean", "train"), ("eval/dense/reward", "eval")]),
        Panel("completion length", [("length/mean", "mean")], "tokens"),
        Panel("mismatch KL", [(_REJECT + "kl", "k1"), (_REJECT + "k3_kl", "k3")]),
        Panel("sequence rejection rate", [("rejection_rate", "rejected")]),
    ],
)


@dataclass
class Run:
    """A run's metrics as series: key -> (steps, values), NaN for a logged null (non-finite value)."""

    label: str
    path: Path
    series: dict[str, tuple[list[int], list[float]]]
    bad_lines: int = 0


def metrics_path(run: str | Path) -> Path:
    """RUN_DIR/metrics.jsonl, or the path itself when it is a .jsonl file; FileNotFoundError otherwise."""
    p = Path(run)
    if p.is_file():
        return p
    if p.is_dir():
        if (p / METRICS_FILE).is_file():
            return p / METRICS_FILE
        raise FileNotFoundError(
            f"{p}/{METRICS_FILE} not found: is {p} a sparserl run directory (trained with logging.jsonl=true)?"
        )
    raise FileNotFoundError(f"run directory {p} does not exist")


def read_run(run: str | Path, label: str | None = None) -> Run:
    """Parse a metrics.jsonl; a repeated step keeps its last value (a resumed run), a cut line is skipped."""
    path = metrics_path(run)
    by_key: dict[str, dict[int, float]] = {}
    bad = 0
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # a line cut by a kill
            continue
        if not isinstance(row, dict) or "step" not in row:
            raise ValueError(f"{path}:{lineno}: a metrics row must be a JSON object with a 'step'")
        step = int(row["step"])
        for key, value in row.items():
            if key in ("step", "time") or isinstance(value, bool):
                continue
            if value is None:
                value = math.nan
            if isinstance(value, (int, float)):
                by_key.setdefault(key, {})[step] = float(value)
    if not by_key:
        raise ValueError(f"{path}: no metrics rows")
    series = {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in by_key.items()}
    name = label or (path.parent.name if path.name == METRICS_FILE else path.stem)
    return Run(name, path, series, bad)


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over the finite values in the window."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def _unique_labels(runs: list[Run]) -> None:
    names = [r.label for r in runs]
    for r in runs:
        if names.count(r.label) > 1:
            r.label = f"{r.path.parent.parent.name}/{r.label}" if r.path.name == METRICS_FILE else str(r.path)


# one run: a color per series; several: a color per run and a line style (then marker) per series
LINE_STYLES = [("-", None), ("--", None), (":", None), ("-.", None), ("-", "x"), ("--", "x"), (":", "x")]


def _draw_panel(ax: Any, panel: Panel, runs: list[Run], colors: list[str], smooth: int) -> None:
    """One panel: every run's series of it (smoothed over `smooth` steps, the raw line faint behind)."""
    from matplotlib.ticker import MaxNLocator

    multi_series = sum(1 for k, _ in panel.series if any(k in r.series for r in runs)) > 1
    positive = True
    for ri, run in enumerate(runs):
        for si, (key, name) in enumerate(panel.series):
            if key not in run.series:
                continue
            color = colors[(ri if len(runs) > 1 else si) % len(colors)]
            style, marker = LINE_STYLES[si % len(LINE_STYLES)] if len(runs) > 1 else ("-", None)
            steps, values = run.series[key]
            values = [v * panel.scale for v in values]
            positive &= all(v > 0 for v in values if math.isfinite(v))
            label = name if len(runs) == 1 else f"{run.label}: {name}" if multi_series else run.label
            if panel.markers or len(steps) <= 3:
                marker = "o"
            smoothed = smooth > 1 and len(values) > smooth
            if smoothed:  # the raw line faint behind the smoothed one
                ax.plot(steps, values, linestyle=style, color=color, alpha=0.25, linewidth=1)
                values = _smooth(values, smooth)
            ax.plot(steps, values, linestyle=style, color=color, label=label, marker=marker,
                    linewidth=1.8 if smoothed else 1.6)  # fmt: skip
    if panel.logy and positive:
        ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def draw_figure(
    fig_spec: Figure, runs: list[Run], out: Path, smooth: int = 0
) -> tuple[Path | None, list[str]]:
    """Draw one figure's panels that have data; returns (PNG path or None, notes on what was skipped)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in fig_spec.panels if any(k in r.series for r in runs for k, _ in p.series)]
    notes = [
        f"{fig_spec.name}: skipped panel '{p.title}' (none of {', '.join(k for k, _ in p.series)} logged)"
        for p in fig_spec.panels
        if p not in panels
    ]
    if not panels:
        return None, [f"{fig_spec.name}.png not written: none of its metrics are in the logs"]
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.9 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        _draw_panel(ax, panel, runs, colors, smooth)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if len(runs) == 1:
        title = f"{fig_spec.title} ({runs[0].label})"
    else:
        title = f"{fig_spec.title}: {' vs '.join(r.label for r in runs)}"
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{fig_spec.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, notes


def plot_runs(runs: list[str | Path], out: str | Path | None = None, smooth: int = 0) -> dict[str, Any]:
    """Draw every figure for the runs (overlaid when several) into `out` (default: RUN_DIR/plots for one
    run, ./plots for several). Returns {'out': dir, 'written': [PNG paths], 'notes': [what was skipped]}."""
    if not runs:
        raise ValueError("plot: give at least one run directory")
    loaded = [read_run(r) for r in runs]
    _unique_labels(loaded)
    if out is None:
        out = loaded[0].path.parent / PLOTS_DIR if len(loaded) == 1 else Path(PLOTS_DIR)
    out = Path(out)
    written: list[Path] = []
    notes = [f"{r.path}: skipped {r.bad_lines} unreadable line(s)" for r in loaded if r.bad_lines]
    for spec in [OVERVIEW, *FIGURES]:
        path, fig_notes = draw_figure(spec, loaded, out, smooth)
        if path is not None:
            written.append(path)
        if spec is not OVERVIEW:
            notes += fig_notes
    return {"out": out, "written": written, "notes": notes}


def main(runs: list[str], out: str | None = None, smooth: int = 0) -> int:
    """`sparserl plot`: draw the PNGs and list them (and what was skipped) on stderr."""
    import sys

    try:
        if smooth < 0:
            raise ValueError(f"--smooth={smooth} must be >= 0")
        result = plot_runs(runs, out, smooth)
    except ValueError as e:  # a malformed metrics file: the message names it
        print(f"sparserl plot: error: {e}", file=sys.stderr)
        return 1
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    for path in result["written"]:
        print(path)
    return 0
