"""Checkpoints that resume exactly: weights (or the LoRA adapter), optimizer, scheduler, every RNG state, data
position and step, written atomically (temp dir + rename) so a kill mid-write leaves the previous one intact."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    """What the loop needs besides tensors and parts to continue: step, counters, the initial eval."""

    step: int = 0
    engine_seed: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    history: dict[str, Any] = field(default_factory=dict)
    rollout: dict[str, Any] = field(default_factory=dict)  # the rollout layer's counters (RolloutState)


def checkpoint_root(run_dir: str | Path) -> Path:
    """Directory holding a run's checkpoints."""
    return Path(run_dir) / CHECKPOINT_DIR


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives (whether or not it exists)."""
    return checkpoint_root(run_dir) / f"step-{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first. Temp dirs of interrupted writes are ignored."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found) if (p / STATE_FILE).is_file()]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch and (on a GPU machine) CUDA RNG states, in a form torch.load(weights_only=True)
    accepts."""
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []  # none in older checkpoints, or from a machine without a GPU
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir beside `final` to write into; on success rename it to `final` (an existing `final` is
    moved aside first and deleted after, so one complete copy exists at every moment); on any error or kill
    the temp dir is removed (or left as a `.tmp-*` leftover that readers ignore, and the next successful write
    of `final` deletes). A full disk is reported as such, with the path, whatever layer hit it (torch reports
    it as an opaque 'enforce fail')."""
    new_parent = not final.parent.exists()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-old-", dir=final.parent))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if new_parent:  # leave no empty folder behind (e.g. checkpoints/ when the first save fails)
            with contextlib.suppress(OSError):
                final.parent.rmdir()
        if _disk_full(e):
            raise OSError(errno.ENOSPC, f"No space left on device while writing {final}") from e
        raise
    remove_leftovers(final)


def remove_leftovers(final: Path) -> None:
    """Delete the `.tmp-{final.name}-*` folders beside `final` that an earlier write killed mid-way left (a
    kill -9 during an export, then a resume that exported again): `final` is complete now, they are garbage."""
    for leftover in final.parent.glob(f".tmp-{glob.escape(final.name)}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _save(obj: Any, path: Path) -> None:
    """torch.save through a Python file object, so a full disk raises OSError(ENOSPC) rather than the C++
    writer's opaque 'enforce fail ... unexpected pos'."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def _disk_full(e: BaseException) -> bool:
    """True for ENOSPC however it surfaces: OSError, torch's C++ writer, safetensors' Rust writer."""
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    signs = (
        "No space left",
        "os error 28",
        "unexpected pos",
        "file write failed",
        "PytorchStreamWriter failed",
    )
    return any(sign in str(e) for sign in signs)


def save_checkpoint(
    run_dir: str | Path,
    state: TrainerState,
    weights: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    keep_last: int,
    weights_name: str = "model.safetensors",
    parts: dict[str, Part] | None = None,
) -> Path:
    """Write checkpoint `step-NNNNNN` atomically, then delete all but the newest `keep_last` checkpoints.
    Each of `parts` (a second trained component, e.g. the DistillSparse adapter) goes to its own sub-folder.

    Everything goes to a temp dir beside the final one; a rename publishes it. A kill before the rename
    leaves only a temp dir, which `list_checkpoints` ignores and the next save cleans up.
    """
    final = checkpoint_path(run_dir, state.step)
    with atomic_dir(final) as tmp:
        # safetensors refuses shared storage (tied embeddings): store contiguous, unshared copies.
        save_file({k: v.detach().contiguous().clone() for k, v in weights.items()}, tmp / weights_name)
        for name, obj in (("optimizer", optimizer.state_dict()), ("scheduler", scheduler.state_dict())):
            _save(obj, tmp / f"{name}.pt")
        _save(rng_state(), tmp / "rng.pt")
        for name, part in (parts or {}).items():
            _save_part(part, tmp / name)
        (tmp / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1, sort_keys=True))
        _fsync_tree(tmp)
    prune_checkpoints(run_dir, keep_last)
    return final


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and leftovers of interrupted writes."""
    ckpts = list_checkpoints(run_dir)
    for old in ckpts[: max(0, len(ckpts) - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in checkpoint_root(run_dir).glob(".tmp-step-*"):
        shutil.rmtree(leftover, ignore_errors=True)


PART_WEIGHTS = "adapter.safetensors"
PART_OPTIMIZER = "optimizer.pt"
PART_STATE = "state.json"


@dataclass
class Part:
    """A named component's share of a checkpoint (its own sub-folder): the weights and optimizer of a
    component trained beside the policy (DistillSparse's adapter), and the JSON state of a stateful part of the
    loop (the group source's data position and leftover groups)."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


def _save_part(part: Part, folder: Path) -> None:
    folder.mkdir()
    if part.weights:
        save_file(
            {k: v.detach().contiguous().clone() for k, v in part.weights.items()}, folder / PART_WEIGHTS
        )
    if part.optimizer:
        _save(part.optimizer, folder / PART_OPTIMIZER)
    (folder / PART_STATE).write_text(json.dumps(part.state, sort_keys=True))


def _load_part(folder: Path) -> Part:
    weights, optimizer = folder / PART_WEIGHTS, folder / PART_OPTIMIZER
    return Part(
        load_file(weights) if weights.is_file() else {},
        torch.load(optimizer, map_location="cpu", weights_only=True) if optimizer.is_file() else {},
        json.loads((folder / PART_STATE).read_text()) if (folder / PART_STATE).is_file() else {},
    )


def _upgrade(saved: dict[str, Any], parts: dict[str, Part]) -> TrainerState:
    """A TrainerState from its JSON; checkpoints written before the group source and the add-ons saved parts
    of their own kept the data position and leftover groups in it (moved to the source's part), and each
    add-on's state under the add-on's name (moved to the add-on's part, whose folder held its weights)."""
    position, rollout = saved.pop("data_position", None), saved.get("rollout", {})
    if position is not None and SOURCE_PART not in parts:
        buffer = {"leftover": rollout.pop("leftover", []), "dropped_groups": rollout.pop("dropped_groups", 0)}
        parts[SOURCE_PART] = Part(state={**buffer, "inner": {"position": position}})
    for name in sorted(set(saved) - {f.name for f in fields(TrainerState)}):
        state = saved.pop(name)
        if name in parts and not parts[name].state:
            parts[name].state = state
        elif state:  # an empty entry is an add-on that was off
            raise ValueError(
                f"trainer_state.json holds {name!r}, which is neither a field nor an add-on's part"
            )
    return TrainerState(**saved)


SOURCE_PART = "source"  # the group source's state


@dataclass
class Checkpoint:
    """A loaded checkpoint: hand its parts to the model, optimizer and scheduler, then `restore_rng()`."""

    path: Path
    state: TrainerState
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    parts: dict[str, Part] = field(default_factory=dict)

    def restore_rng(self) -> None:
        """Put python, numpy and torch RNGs back where they were at save time."""
        set_rng_state(self.rng)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint directory written by `save_checkpoint`; a clear error names a damaged file."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a sparserl checkpoint (no {STATE_FILE})")
    weight_files = sorted(path.glob("*.safetensors"))
    if len(weight_files) != 1:
        raise FileNotFoundError(f"{path}: expected one .safetensors weights file, found {len(weight_files)}")
    try:
        saved = json.loads((path / STATE_FILE).read_text())
        weights = load_file(weight_files[0])
        optimizer = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        scheduler = torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True)
        rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
        parts = {
            sub.name: _load_part(sub)
            for sub in sorted(path.iterdir())
            if any((sub / f).is_file() for f in (PART_WEIGHTS, PART_OPTIMIZER, PART_STATE))
        }
        state = _upgrade(saved, parts)
    except Exception as e:  # noqa: BLE001 - re-raised with the culprit named
        raise RuntimeError(f"checkpoint {path} is damaged: {type(e).__name__}: {e}") from e
    return Checkpoint(path, state, weights, optimizer, scheduler, rng, parts)


def load_latest_intact(run_dir: Path, notes: list[str]) -> Checkpoint:
    """The newest checkpoint of `run_dir` that reads back whole; damaged newer ones are skipped and said so
    (appended to `notes`)."""
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise FileNotFoundError(f"--resume: {run_dir} has no complete checkpoint to resume from")
    for path in reversed(ckpts):
        try:
            return load_checkpoint(path)
        except (RuntimeError, FileNotFoundError) as e:
            notes.append(f"[yellow]skipping damaged checkpoint[/yellow] {path.name}: {e}")
    raise FileNotFoundError(
        f"--resume: every checkpoint in {run_dir} is damaged ({', '.join(p.name for p in ckpts)})"
    )
