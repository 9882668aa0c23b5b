"""Run directories and the settings around a run: locks, unique names, what a resume may change, damaged
checkpoints, atomic export, failed starts, data rows that do not fit, dense evaluation, data-path settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_trainer import make_trainer, tiny_cfg

from sparserl.config import ConfigError, load_config
from sparserl.errors import DataError
from sparserl.models import ModelLoadError
from sparserl.tasks.dataset import DatasetTask, is_local_source
from sparserl.trainer import Trainer, list_checkpoints, resume_config
from sparserl.trainer.checkpoint import atomic_dir
from sparserl.trainer.run_dir import LOCK_FILE, RunDirBusy, RunLock, new_run_dir


def test_a_second_run_in_the_same_directory_fails_at_once(tmp_path: Path) -> None:
    first = make_trainer(tiny_cfg(tmp_path))
    with pytest.raises(RunDirBusy, match="in use by another sparserl run"):
        make_trainer(tiny_cfg(tmp_path))
    first.close()
    make_trainer(tiny_cfg(tmp_path)).close()  # free again once the first run is closed


def test_a_closed_run_leaves_no_lock_file_and_a_lock_freed_meanwhile_is_not_shared(tmp_path: Path) -> None:
    """A finished run's folder holds no .lock; a lock opened on the file its holder then removes is retried on
    the new file, so two runs never both believe they hold the directory."""
    first = make_trainer(tiny_cfg(tmp_path))
    run = first.run_dir
    assert (run / LOCK_FILE).is_file()
    first.close()
    assert not (run / LOCK_FILE).exists()
    held = RunLock(run)
    stale = os.open(run / LOCK_FILE, os.O_RDWR)  # a second run that opened the file before the release
    held.release()
    again = RunLock(run)  # takes a new file
    assert os.fstat(stale).st_ino != os.stat(run / LOCK_FILE).st_ino
    os.close(stale)
    with pytest.raises(RunDirBusy):
        RunLock(run)
    again.release()


def test_automatic_run_names_are_unique_within_one_second(tmp_path: Path) -> None:
    cfg = tiny_cfg(tmp_path, "trainer.run_name=null")
    dirs = {new_run_dir(cfg) for _ in range(20)}
    assert len(dirs) == 20 and all(d.is_dir() for d in dirs)


def test_resume_writes_allowed_overrides_and_refuses_the_others(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_trainer(tiny_cfg(tmp_path, "trainer.steps=2")).train()
    with pytest.raises(ConfigError, match=r"model\.lora_r .*may change only"):
        resume_config(run, ["model.lora_r=8"])
    with pytest.raises(ConfigError, match="model.spec"):
        resume_config(run, ["model.spec=tiny-qwen3"])
    cfg = resume_config(run, ["trainer.steps=3"])
    make_trainer(cfg, run_dir=run, resume=True).train(until_step=3)
    assert load_config(run / "config.yaml").trainer.steps == 3  # a later plain resume sees the new length
    assert resume_config(run).trainer.steps == 3


def test_resume_from_python_with_other_settings_is_refused(tmp_path: Path) -> None:
    make_trainer(tiny_cfg(tmp_path, "trainer.steps=1")).train()
    with pytest.raises(ConfigError, match="optim.lr"):
        make_trainer(tiny_cfg(tmp_path, "optim.lr=0.5"), run_dir=tmp_path / "run", resume=True)


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path: Path) -> None:
    make_trainer(tiny_cfg(tmp_path, "trainer.steps=2")).train()
    latest = list_checkpoints(tmp_path / "run")[-1]
    weights = latest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    resumed = make_trainer(tiny_cfg(tmp_path, "trainer.steps=2"), run_dir=tmp_path / "run", resume=True)
    assert resumed.state.step == 1 and resumed.resumed_from.name == "step-000001"
    assert any("damaged" in note and "step-000002" in note for note in resumed.notes)


def test_lora_weights_of_another_shape_are_named(tmp_path: Path) -> None:
    small = make_trainer(tiny_cfg(tmp_path, "model.lora=true", "model.lora_r=4", name="r4"))
    large = make_trainer(tiny_cfg(tmp_path, "model.lora=true", "model.lora_r=8", name="r8"))
    with pytest.raises(ModelLoadError, match=r"shape .*lora_A.*\(4, .*\(8, "):
        large.policy.load_weights(small.policy.weights(), "step-000001")


def test_export_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = make_trainer(tiny_cfg(tmp_path))
    final = trainer.policy.export(tmp_path / "final")
    before = sorted(p.name for p in final.iterdir())

    def killed(path: Path) -> None:
        (path / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.policy, "_save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        trainer.policy.export(tmp_path / "final")
    assert sorted(p.name for p in final.iterdir()) == before  # the complete old export is untouched
    with pytest.raises(KeyboardInterrupt):
        trainer.policy.export(tmp_path / "other")
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".tmp-*"))


def test_a_new_export_removes_leftovers_of_a_killed_one(tmp_path: Path) -> None:
    for name in (".tmp-final-k1l2", ".tmp-final-old-x9"):  # what kill -9 mid-export leaves
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / ".tmp-finale-abc").mkdir()  # another folder's leftover: not ours to delete
    with atomic_dir(tmp_path / "final") as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-finale-abc", "final"]


def test_a_full_disk_names_itself_and_the_path(tmp_path: Path) -> None:
    with (
        pytest.raises(OSError, match="No space left on device while writing .*ckpt"),
        atomic_dir(tmp_path / "ckpt"),
    ):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file"
        )


def test_a_failed_start_leaves_no_run_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        make_trainer(tiny_cfg(tmp_path, "model.lora=true", "model.lora_targets=no_such_proj"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError):
        Trainer(tiny_cfg(tmp_path, "trainer.run_name=null", "model.lora=true", "model.lora_targets=nope"))
    assert list(tmp_path.iterdir()) == []


def _rows(tmp_path: Path, lengths: list[int]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"question": "x" * n, "answer": "1"}) + "\n" for n in lengths))
    return path


def test_a_prompt_that_does_not_fit_is_skipped_with_its_line(tmp_path: Path) -> None:
    data = _rows(tmp_path, [5, 5000, 5])  # the tiny model has 4096 positions
    cfg = tiny_cfg(tmp_path, f"task.data={data}")
    trainer = Trainer(cfg, task=DatasetTask(cfg.task, "train", str(data)))
    assert trainer.train_rows == [0, 2]
    assert any(f"{data}:2" in note for note in trainer.notes)
    trainer.close()
    cfg = tiny_cfg(tmp_path, f"task.data={data}", "task.on_long_prompt=error", name="strict")
    with pytest.raises(DataError, match=f"{data}:2"):
        Trainer(cfg, task=DatasetTask(cfg.task, "train", str(data)))


def test_evaluation_is_dense_by_default_and_sparse_on_request(tmp_path: Path) -> None:
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.eval_prompts=2"))
    assert trainer.cfg.sparse and trainer.held_out.engines["dense"].evictor is None
    assert {k for k in trainer.evaluate(0) if k.startswith("eval/")} == {
        "eval/dense/reward",
        "eval/dense/length",
    }
    trainer.close()
    trainer = make_trainer(
        tiny_cfg(tmp_path, "trainer.eval_prompts=2", "trainer.eval_sparse=true", name="both")
    )
    assert {k for k in trainer.evaluate(0) if k.startswith("eval/")} == {
        "eval/dense/reward",
        "eval/dense/length",
        "eval/sparse/reward",
        "eval/sparse/length",
    }


def test_a_data_path_selects_the_dataset_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(
        tmp_path
    )  # command-line paths are stored resolved, so that a resume works from anywhere
    cfg = load_config(None, ["task.data=my.jsonl"])
    mine, held = str(tmp_path / "my.jsonl"), str(tmp_path / "held.jsonl")
    assert cfg.task.name == mine and cfg.task.system_prompt == ""  # not the arithmetic default's
    with pytest.raises(ConfigError, match="task.name='arithmetic' generates"):
        load_config(None, ["task.name=arithmetic", "task.data=my.jsonl"])
    eval_cfg = load_config(None, ["trainer.eval_data=held.jsonl"]).eval_task_config()
    assert eval_cfg.data == held and eval_cfg.name == held


def test_yaml_data_paths_are_relative_to_the_yaml_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text("task:\n  data: data/train.jsonl\n  name: mine\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("cfg/run.yaml").task.data == str(tmp_path / "cfg" / "data" / "train.jsonl")
    # the command line: resolved against the working directory
    assert load_config(None, ["task.data=data/x.jsonl"]).task.data == str(tmp_path / "data" / "x.jsonl")
    (tmp_path / "cfg" / "sched.yaml").write_text("[[0, 64], [128, 96]]\n")
    (tmp_path / "cfg" / "sched_run.yaml").write_text("kv:\n  method: block_topk\n  schedule: sched.yaml\n")
    assert load_config("cfg/sched_run.yaml").kv.schedule == [[0, 64], [128, 96]]
    # the shipped configs read from the Hub: a clone holds every file they name
    for name in ("gsm8k", "math"):
        cfg = load_config(name)
        assert not is_local_source(cfg.task.data) and not is_local_source(cfg.trainer.eval_data), name


def test_non_utf8_yaml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"trainer:\n  steps: 3 \xff\n")
    with pytest.raises(ConfigError, match="bad.yaml: not UTF-8"):
        load_config(bad)
