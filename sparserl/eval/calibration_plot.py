"""The heatmap of a calibration or schedule check (`sparserl calibrate`): P5 of alpha per budget and length
bin, the tau contour, and the chosen schedule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sparserl.algo.acceptance import TOO_FEW_TOKENS


def plot_heatmap(report: dict[str, Any], path: str | Path) -> Path:
    """Draw the report's table as a heatmap PNG: rows = budgets (or the checked schedule), columns = length
    bins, cells coloured by P5 (0 to 1) and labelled with it and its 90% interval, too-few-token cells grey and
    hatched, the tau contour drawn along the cell edges that separate passing cells from failing ones (judged
    by the report's `judged_by`: the interval's lower bound, or P5), and the chosen schedule's cells outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    s, rows = report["settings"], report["table"]
    judged_by = report.get("judged_by", "p5")

    def grid(stat: str) -> np.ndarray:
        return np.array(
            [[np.nan if b[stat] is None else b[stat] for b in row["bins"]] for row in rows], float
        )

    p5, tail = grid("p5"), grid(judged_by)
    n_rows, n_bins = p5.shape
    measured = ~np.isnan(tail)
    passes = measured & (np.nan_to_num(tail) >= s["tau"])
    fig, ax = plt.subplots(figsize=(2.8 + 0.85 * n_bins, 1.9 + 0.42 * n_rows))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    norm = TwoSlopeNorm(vmin=0.0, vcenter=min(s["tau"], 0.999), vmax=1.0)  # red below tau, green above
    image = ax.imshow(np.ma.masked_invalid(p5), cmap=cmap, norm=norm, aspect="auto", origin="lower")
    for (r, c), value in np.ndenumerate(p5):
        cell = rows[r]["bins"][c]
        if measured[r, c]:
            interval = (
                f"\n[{cell['p5_low']:.2f}, {cell['p5_high']:.2f}]" if cell.get("p5_low") is not None else ""
            )
            ax.text(
                c, r, f"{value:.2f}{interval}", ha="center", va="center", fontsize=8 if not interval else 6
            )
        else:
            ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="///", edgecolor="grey", lw=0))
    contour = {"color": "black", "linewidth": 2.5, "zorder": 3}
    for r, c in np.ndindex(n_rows, n_bins):  # the tau contour: edges between a passing and a failing cell
        if c + 1 < n_bins and measured[r, c] and measured[r, c + 1] and passes[r, c] != passes[r, c + 1]:
            ax.plot([c + 0.5, c + 0.5], [r - 0.5, r + 0.5], **contour)
        if r + 1 < n_rows and measured[r, c] and measured[r + 1, c] and passes[r, c] != passes[r + 1, c]:
            ax.plot([c - 0.5, c + 0.5], [r + 0.5, r + 0.5], **contour)
    labels = [row["label"] for row in rows]
    for c, record in enumerate(report.get("schedule_bins", [])):
        r = labels.index(str(record["budget"]))
        ax.add_patch(Rectangle((c - 0.4, r - 0.4), 0.8, 0.8, fill=False, edgecolor="blue", linewidth=2))
    ax.set_xticks(
        range(n_bins), [f"{b['start']}-{b['end']}" for b in report["bins"]], rotation=45, ha="right"
    )
    ax.set_yticks(range(n_rows), labels)
    ax.set_xlabel("absolute position (length bin)")
    ax.set_ylabel("budget" if report["kind"] == "calibration" else "")
    ax.set_title(
        f"P5 of alpha ({s['estimate']}), {s['method']}, {report['prompts']} prompt(s) x {s['n']}", fontsize=10
    )
    bar = fig.colorbar(image, ax=ax, label="P5")
    bar.ax.axhline(s["tau"], color="black", linewidth=2)
    legend = [
        Line2D([], [], **contour, label=f"{'P5' if judged_by == 'p5' else 'lower bound'} = tau ({s['tau']})"),
        Patch(facecolor="lightgrey", hatch="///", edgecolor="grey", label=TOO_FEW_TOKENS),
    ]
    if report.get("schedule_bins"):
        legend.append(Patch(fill=False, edgecolor="blue", linewidth=2, label="schedule"))
    fig.legend(handles=legend, fontsize=8, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
