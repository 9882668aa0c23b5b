"""Trackers and the completions table: two tiny-model steps with W&B (offline), MLflow (a local file store) or
Trackio on leave each step's metrics in the tracker's own store; every run writes completions.jsonl (capped per
step), TensorBoard's text table, and what reward functions log from the worker (log_metric, log_extra)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_trainer import ParityTask, rows, tiny_cfg

from sparserl.trainer import Trainer
from sparserl.trainer.completions import COLUMNS, COMPLETIONS_FILE

TRACKING = "pip install 'sparserl[tracking]'"
REWARD_PY = """
def odd_length(completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    log_metric("global_step", trainer_state.global_step)
    log_extra("n_ids", [len(ids) for ids in completion_ids])
    return [float(len(ids) % 2) for ids in completion_ids]
"""


def two_steps(tmp_path: Path, *extra: str) -> Path:
    """Two steps of the tiny model, rewarded by REWARD_PY in the reward worker; the run directory."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "rewards.py").write_text(REWARD_PY)
    cfg = tiny_cfg(tmp_path, "trainer.steps=2", *extra)
    trainer = Trainer(cfg, task=ParityTask(), reward_fn=[f"{tmp_path / 'rewards.py'}:odd_length"])
    trainer.train()
    trainer.close()
    return tmp_path / "run"


def table(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / COMPLETIONS_FILE).read_text().splitlines()]


def test_completions_table_and_reward_logs_land_per_step(tmp_path: Path) -> None:
    run = two_steps(tmp_path)
    steps = [r for r in rows(run) if "reward/mean" in r]
    assert [r["reward_fn/global_step"] for r in steps] == [0.0, 1.0]  # trainer_state: updates done
    got = table(run)
    assert [r["step"] for r in got] == [1] * 8 + [2] * 8  # 2 prompts x 4 samples a step, under the cap
    for r in got:
        assert set(COLUMNS) <= set(r)
        assert r["reward"] == r["n_ids"] % 2  # log_extra's column is the row's own sample
        assert isinstance(r["logp_gap"], float) and isinstance(r["rejected"], bool)
        assert r["prompt"] and isinstance(r["advantage"], float)
    for step in steps:  # completion_ids are the sampled tokens
        lengths = [r["n_ids"] for r in got if r["step"] == step["step"]]
        assert sum(lengths) / len(lengths) == pytest.approx(step["length/mean"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0}).Reload()
    assert "completions/text_summary" in events.Tags()["tensors"]


def test_completions_rows_are_capped_or_off(tmp_path: Path) -> None:
    capped = two_steps(tmp_path / "capped", "logging.completions=3")
    assert [r["step"] for r in table(capped)] == [1, 1, 1, 2, 2, 2]
    off = two_steps(tmp_path / "off", "logging.completions=0")
    assert not (off / COMPLETIONS_FILE).exists()


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """Each step's history record in the offline run's .wandb file: a 7-byte file header, then records in the
    LevelDB log format (32 KiB blocks; a 7-byte header per record: checksum, length, type FULL/FIRST/MIDDLE/
    LAST), each a wandb Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(part)
            part = b""
    history = {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
    return history


def test_wandb_offline_run_holds_the_step_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason=f"logging.wandb needs W&B: {TRACKING}")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    run = two_steps(tmp_path, "logging.wandb=true")
    history = wandb_history(run)
    for step in (r for r in rows(run) if "reward/mean" in r):
        assert history[step["step"]]["reward/mean"] == pytest.approx(step["reward/mean"])
        logged = history[step["step"]]
        assert (logged["completions/_type"], logged["completions/nrows"]) == ("table-file", 8)
    assert len(list(run.glob("wandb/offline-run-*/files/media/table/completions_*.table.json"))) == 2


def test_mlflow_file_store_holds_the_step_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow", reason=f"logging.mlflow needs MLflow (mlflow-skinny is enough): {TRACKING}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this
    run = two_steps(tmp_path, "logging.mlflow=true")
    (metric,) = (tmp_path / "mlruns").glob("*/*/metrics/reward/mean")
    logged = {
        int(step): float(value) for _, value, step in (ln.split() for ln in metric.read_text().splitlines())
    }
    assert logged == {r["step"]: pytest.approx(r["reward/mean"]) for r in rows(run) if "reward/mean" in r}
    tables = sorted(p.name for p in metric.parents[2].glob("artifacts/completions/*.json"))
    assert tables == ["step_000001.json", "step_000002.json"]


def test_trackio_local_store_holds_the_step_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trackio", reason=f"logging.trackio needs Trackio: {TRACKING}")
    store = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] == "trackio"]:
        if hasattr(module, "TRACKIO_DIR"):  # read once, when trackio was imported
            monkeypatch.setattr(module, "TRACKIO_DIR", store)
    project = f"sparserl-test-{tmp_path.name}"
    run = two_steps(tmp_path, "logging.trackio=true", f"logging.trackio_project={project}")
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_project_db_path(project).is_relative_to(store)
    logs = SQLiteStorage.get_logs(project, run.name)
    scalars = {log["step"]: log["reward/mean"] for log in logs if "reward/mean" in log}
    assert scalars == {r["step"]: pytest.approx(r["reward/mean"]) for r in rows(run) if "reward/mean" in r}
    assert sorted(log["step"] for log in logs if "completions" in log) == [1, 2]


def test_a_tracker_not_installed_is_named_before_anything_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from sparserl.config import ConfigError, LoggingConfig
    from sparserl.trainer.logging import check_backends

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    for name in ("wandb", "mlflow", "trackio"):
        with pytest.raises(ConfigError, match=f"logging.{name}=true but {name} is not installed"):
            check_backends(LoggingConfig(**{name: True}))
