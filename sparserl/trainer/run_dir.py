"""A run directory: its unique name, the exclusive lock a live run holds on it, finding one to resume, and
which settings may change when a run is resumed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from sparserl.config import ConfigError, TrainConfig, flatten, load_config
from sparserl.engine.kv_config import DENSE
from sparserl.errors import UserError
from sparserl.trainer.checkpoint import Checkpoint, latest_checkpoint, list_checkpoints, load_latest_intact

CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"
# Settings a resume may change (run length, checkpoints, evaluation, logging and diagnostics, threads, compiling):
# they do not change what was trained so far. `output_dir`/`run_name` only locate the run. Everything else is
# fixed for a run.
RESUMABLE_KEYS = (
    "trainer.steps",  # with optim.schedule=constant only (HORIZON_SCHEDULES)
    "trainer.save_every",
    "trainer.keep_last",
    "trainer.eval_every",
    "trainer.eval_prompts",
    "trainer.eval_data",
    "trainer.eval_sparse",
    "trainer.eval_temperature",
    "trainer.threads",
    "trainer.malloc_mmap_threshold",  # where freed memory goes, not what is computed
    "model.device",  # where the run computes, like trainer.threads: log-probs differ only by rounding
    "trainer.log_acceptance",
    "trainer.acceptance_",
    "logging.",
    "engine.",
    "distributed.learners",  # the update is 1 learner's (to float round-off) and checkpoints have one format
    "distributed.cpus_per_learner",
    "distributed.gpus_per_learner",
    "distributed.fsdp",  # how the ranks hold the policy: the same update (to float round-off), the same checkpoints
    "distill.enable",  # turned on for a run that had none: refused unless distill.fresh_on_resume (loop.py)
    "distill.fresh_on_resume",
    "distill.probe_",
)
LOCATION_KEYS = ("trainer.output_dir", "trainer.run_name")
# lr schedules whose shape depends on the run length: trainer.steps is fixed for them
HORIZON_SCHEDULES = ("linear", "cosine")


class RunDirBusy(UserError):
    """Another live process holds the run directory."""


def new_run_dir(cfg: TrainConfig) -> Path:
    """RUN_DIR for a fresh run: output_dir/run_name, or a new unique '<preset>-<kv>-<time>-<random>' that no
    other run (even one started in the same second) can get: the directory is created here, exclusively.
    <kv> is the sampler's `KVConfig.short_name` (rkv, or rkv-int8 when quantized)."""
    root = Path(cfg.trainer.output_dir)
    if cfg.trainer.run_name:
        return root / cfg.trainer.run_name
    kv = cfg.kv.short_name if cfg.sparse else DENSE
    root.mkdir(parents=True, exist_ok=True)
    while True:
        path = (
            root / f"{cfg.algo.preset}-{kv}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        )
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


class RunLock:
    """An exclusive advisory lock (flock) on RUN_DIR/.lock, held while a Trainer owns the run, so a second
    run or resume into the same directory fails at once instead of mixing configs, metrics and checkpoints.
    The kernel drops it when the process dies, so a killed run never leaves a stale lock; a closed run
    removes the file, so a finished run's folder holds none."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise RunDirBusy(
                    f"{run_dir} is in use by another sparserl run (pid {holder}); wait for it to finish, or "
                    "choose another trainer.run_name"
                ) from None
            if self._still_the_file(fd):
                self._fd = fd
            else:  # its holder removed it on release after we opened it: lock the file there now
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def _still_the_file(self, fd: int) -> bool:
        """Whether the open file `fd` is the one at `self.path` (not one removed since it was opened)."""
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.path))
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()


def find_resumable(output_dir: str | Path) -> Path:
    """The most recently written run under `output_dir` that has a checkpoint (for a bare `--resume`)."""
    root = Path(output_dir)
    runs = [p.parent.parent for p in root.glob("*/checkpoints/step-*")] if root.is_dir() else []
    runs = [r for r in set(runs) if latest_checkpoint(r) is not None]
    if not runs:
        raise FileNotFoundError(f"--resume: no run with a checkpoint under {root}/; give the run directory")
    return max(runs, key=lambda r: latest_checkpoint(r).stat().st_mtime)  # type: ignore[union-attr]


def resume_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config a run was started with (RUN_DIR/config.yaml), plus `overrides` (e.g. trainer.steps=20);
    an override of a setting that is fixed for a run is an error naming it."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume {run_dir}: no {CONFIG_FILE} there; is it a sparserl run directory?"
        )
    cfg = load_config(path, overrides)
    check_resume_changes(load_config(path), cfg)
    return cfg


def check_resume_changes(saved: TrainConfig, new: TrainConfig) -> None:
    """Raise ConfigError if `new` differs from the run's `saved` config outside RESUMABLE_KEYS, or changes
    trainer.steps under an lr schedule whose horizon it sets (linear, cosine)."""
    old, cur = flatten(saved.to_dict()), flatten(new.to_dict())
    fixed = [
        f"{k} (run: {old.get(k)!r}, now: {cur.get(k)!r})"
        for k in sorted(set(old) | set(cur))
        if old.get(k) != cur.get(k) and not k.startswith(RESUMABLE_KEYS + LOCATION_KEYS)
    ]
    if fixed:
        raise ConfigError(
            f"--resume cannot change settings that shaped the run so far: {'; '.join(fixed)}. A resume may "
            f"change only {', '.join(k.rstrip('.') + ('.*' if k.endswith('.') else '') for k in RESUMABLE_KEYS)}"
            "; start a new run for the others"
        )
    if saved.trainer.steps != new.trainer.steps and new.optim.schedule in HORIZON_SCHEDULES:
        raise ConfigError(
            f"--resume cannot change trainer.steps (run: {saved.trainer.steps}, now: {new.trainer.steps}) with "
            f"optim.schedule={new.optim.schedule!r}: the lr schedule's horizon is trainer.steps, so the lr "
            "from here on would jump and follow another curve; keep trainer.steps, or start a new run "
            "(optim.schedule=constant runs may be extended)"
        )


def checkpoint_to_resume(
    run_dir: Path, cfg: TrainConfig, resume: bool, notes: list[str]
) -> Checkpoint | None:
    """With `resume`, the run's latest intact checkpoint, once the settings changed since its config.yaml are
    allowed; without, None, and a directory that already holds checkpoints is refused."""
    if not resume:
        if list_checkpoints(run_dir):
            raise FileExistsError(
                f"{run_dir} already holds checkpoints: resume it with `sparserl train --resume {run_dir}` "
                "or choose another trainer.run_name"
            )
        return None
    saved = run_dir / CONFIG_FILE
    if saved.is_file():
        check_resume_changes(load_config(saved), cfg)
    return load_latest_intact(run_dir, notes)
