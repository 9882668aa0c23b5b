"""`sparserl plot`: PNGs from a synthetic metrics.jsonl, overlays of several runs, skipped metrics, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from sparserl.plot import FIGURES, OVERVIEW, main, plot_runs, read_run


def write_run(root: Path, name: str, steps: int = 12, sparse: bool = True, extra_lines: str = "") -> Path:
    """A run directory with the metric names the trainer logs (sparserl/trainer/loop.py)."""
    run = root / name
    run.mkdir(parents=True)
    lines = [json.dumps({"step": 0, "time": 0.0, "eval/dense/reward": 0.2, "eval/dense/length": 80.0})]
    for s in range(1, steps + 1):
        row = {
            "step": s,
            "time": float(s),
            "reward/mean": 0.2 + 0.05 * s,
            "reward/std": 0.3,
            "reward/max": 1.0,
            "length/mean": 100 - 2 * s,
            "length/max": 160,
            "length/truncated_frac": 0.5 / s,
            "rejection_rate": 0.1 if sparse else 0.0,
            "rollout_corr/kl": 0.01 * math.sin(s) if sparse else 0.0,
            "rollout_corr/k3_kl": 0.02 / s if sparse else 0.0,
            "rollout_corr/chi2_token": 0.1 + 0.01 * s,
            "rollout_corr/chi2_seq": None if s == 3 else 10.0 * s,  # a non-finite value logged as null
            "rollout_corr/ess": 0.9,
            "rollout_corr/veto_fraction": 0.05,
            "rollout_corr/token_keep_fraction": 0.95,
            "kv/saved_fraction": 0.6 if sparse else 0.0,
            "rollout/peak_kv_bytes": 2**20 * (1 if sparse else 3),
            "kv/dense_kv_bytes": 3 * 2**20,
            "actor/loss": 0.1 / s,
        }
        lines.append(json.dumps(row))
    lines.append(
        json.dumps({"step": steps, "time": 99.0, "eval/dense/reward": 0.6, "eval/dense/length": 70.0})
    )
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n" + extra_lines)
    return run


def test_read_run_series(tmp_path: Path) -> None:
    run = write_run(tmp_path, "a", steps=5, extra_lines='{"step": 6, "reward/me')  # a line cut by a kill
    r = read_run(run)
    assert r.label == "a" and r.bad_lines == 1
    steps, values = r.series["reward/mean"]
    assert steps == [1, 2, 3, 4, 5] and values[0] == pytest.approx(0.25)
    assert r.series["eval/dense/reward"] == ([0, 5], [0.2, 0.6])
    assert math.isnan(r.series["rollout_corr/chi2_seq"][1][2])
    assert "time" not in r.series


def test_plot_writes_pngs_and_skips_missing(tmp_path: Path) -> None:
    run = write_run(tmp_path, "sparse-rl-rkv")
    out = plot_runs([run])
    assert out["out"] == run / "plots"
    names = {p.name for p in out["written"]}
    assert {
        "overview.png",
        "reward.png",
        "length.png",
        "mismatch.png",
        "rejection.png",
        "kv.png",
        "optim.png",
    } <= names
    for path in out["written"]:
        img = mpimg.imread(path)
        assert img.shape[0] > 300 and img.shape[1] > 500
        assert img[..., :3].std() > 0.01  # not a blank canvas
    notes = "\n".join(out["notes"])
    assert "Seq-MIS" not in notes  # notes name metrics, not labels
    assert "seq_mis_rejected_fraction" in notes  # a panel with none of its metrics is skipped with a note
    assert "gradient norm" in notes


def test_plot_figure_without_any_metric_is_skipped(tmp_path: Path) -> None:
    run = tmp_path / "dense-only"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "reward/mean": s / 10, "length/mean": 50}) for s in range(1, 4))
    )
    out = plot_runs([run], tmp_path / "figs")
    names = {p.name for p in out["written"]}
    assert names == {"overview.png", "reward.png", "length.png"}
    assert any("mismatch.png not written" in n for n in out["notes"])
    assert any("rejection.png not written" in n for n in out["notes"])


def test_plot_overlays_runs(tmp_path: Path) -> None:
    dense = write_run(tmp_path / "x", "run", sparse=False)
    sparse = write_run(tmp_path / "y", "run", sparse=True)
    out = plot_runs([dense, sparse], tmp_path / "compare", smooth=3)
    assert out["out"] == tmp_path / "compare"
    assert (tmp_path / "compare" / "mismatch.png").is_file()
    # the same run name twice is told apart by its parent directory
    import matplotlib

    matplotlib.use("Agg")
    from sparserl.plot import _unique_labels

    runs = [read_run(dense), read_run(sparse)]
    _unique_labels(runs)
    assert [r.label for r in runs] == ["x/run", "y/run"]


def test_figure_specs_use_logged_metric_names() -> None:
    """Every plotted key is a metric the trainer or the algorithm logs (docs/metrics.md or loop.py)."""
    root = Path(__file__).resolve().parents[1]
    known = (root / "docs" / "metrics.md").read_text() + (
        root / "sparserl" / "trainer" / "loop.py"
    ).read_text()
    keys = {k for fig in [OVERVIEW, *FIGURES] for p in fig.panels for k, _ in p.series}
    rollout_stats = {
        "peak_kv_bytes",
        "retained_fraction",
        "tokens_per_s",
    }  # engine stats, logged as rollout/*
    missing = [
        k
        for k in keys
        if f"`{k}`" not in known and f'"{k}"' not in known and k.split("/", 1)[1] not in rollout_stats
    ]
    assert not missing, missing


def test_plot_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_runs([tmp_path / "missing"])
    (tmp_path / "not-a-run").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        plot_runs([tmp_path / "not-a-run"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"reward/mean": 1.0}\n')
    assert main([str(bad)]) == 1
    assert "metrics.jsonl:1" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics rows"):
        plot_runs([empty])
