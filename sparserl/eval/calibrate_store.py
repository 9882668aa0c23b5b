"""Where a long calibration keeps its finished units (one KV policy x one prompt: the alpha of every token
sampled), so that `sparserl calibrate --resume` continues after the last finished one instead of starting over.

Each unit is a safetensors file of its tokens' positions, alpha estimates and sample numbers, with the fingerprint
of what it measured (the settings, its KV policy and its prompt) in its metadata: a resume reads a unit only when
that fingerprint is the one asked for, and measures it again otherwise, so changing one prompt or one flag costs
the units it touches, never a mix of two calibrations.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sparserl.engine.acceptance import TokenAcceptance


def fingerprint(settings: dict[str, Any], label: str, kv: dict[str, Any], prompt_ids: list[int]) -> str:
    """A digest of everything one unit's numbers depend on: the settings, its KV policy and its prompt."""
    text = json.dumps({"settings": settings, "label": label, "kv": kv, "prompt": prompt_ids}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class UnitStore:
    """Finished calibration units under `directory` (created on first use). With `resume` False an existing
    store is cleared; with `resume` True a unit is read when its fingerprint matches (`stale` counts those
    that did not and are measured again)."""

    def __init__(self, directory: str | Path, resume: bool):
        self.directory = Path(directory)
        if not resume:
            for old in self.directory.glob("*.safetensors"):
                old.unlink()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stale = 0

    def _path(self, label: str, prompt: int) -> Path:
        return self.directory / f"{label}-prompt{prompt}.safetensors"

    def load(self, label: str, prompt: int, digest: str) -> TokenAcceptance | None:
        """The unit's tokens, or None when it has not finished or measured something else."""
        path = self._path(label, prompt)
        if not path.exists():
            return None
        with safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("fingerprint") != digest:
                self.stale += 1
                return None
        t = load_file(path)
        return TokenAcceptance(t["positions"], t["topk"], t.get("exact"), t["sequences"])

    def save(self, label: str, prompt: int, alpha: TokenAcceptance, digest: str, device: str = "cpu") -> None:
        """Keep a finished unit with its fingerprint and the device it was measured on (same numbers up to
        rounding: float32 without TF32 either way)."""
        write_acceptance(self._path(label, prompt), alpha, {"fingerprint": digest, "device": device})


def write_acceptance(path: Path, alpha: TokenAcceptance, metadata: dict[str, str] | None = None) -> None:
    """A measurement's tokens to safetensors atomically (a file renamed into place: a killed run leaves no half
    file); `exact` only when measured."""
    tensors = {"positions": alpha.positions, "topk": alpha.topk, "sequences": alpha.sequences}
    if alpha.exact is not None:
        tensors["exact"] = alpha.exact
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    tmp.replace(path)
