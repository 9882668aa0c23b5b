"""Where a long calibration keeps its finished units (one KV policy x one prompt: the alpha of every token
sampled), so that `sparserl calibrate --resume` continues after the last finished one instead of starting over.

Each unit is a safetensors file of its tokens' positions, alpha estimates and sample numbers; `store.json`
holds the fingerprint of what was measured (settings, KV policies, prompts), and a resume whose fingerprint
differs is refused rather than mixing two calibrations.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from sparserl.engine.acceptance import TokenAcceptance
from sparserl.errors import UserError

FINGERPRINT_JSON = "store.json"


def fingerprint(settings: dict[str, Any], labels: list[str], prompt_ids: list[list[int]]) -> str:
    """A digest of everything a unit's numbers depend on: the settings, the KV policies and the prompts."""
    text = json.dumps({"settings": settings, "labels": labels, "prompts": prompt_ids}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class UnitStore:
    """Finished calibration units under `directory` (created on first use). With `resume` False an existing
    store is cleared; with `resume` True it must hold the same fingerprint."""

    def __init__(self, directory: str | Path, digest: str, resume: bool):
        self.directory = Path(directory)
        marker = self.directory / FINGERPRINT_JSON
        if resume and marker.exists() and json.loads(marker.read_text())["fingerprint"] != digest:
            raise UserError(
                f"--resume: {self.directory} holds a calibration with other settings, budgets or prompts; "
                "run with the same flags, or without --resume to start over"
            )
        if not resume:
            for old in self.directory.glob("*.safetensors"):
                old.unlink()
        self.directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"fingerprint": digest}))

    def _path(self, label: str, prompt: int) -> Path:
        return self.directory / f"{label}-prompt{prompt}.safetensors"

    def load(self, label: str, prompt: int) -> TokenAcceptance | None:
        """The unit's tokens, or None when it has not finished."""
        path = self._path(label, prompt)
        if not path.exists():
            return None
        t = load_file(path)
        return TokenAcceptance(t["positions"], t["topk"], t.get("exact"), t["sequences"])

    def save(self, label: str, prompt: int, alpha: TokenAcceptance) -> None:
        write_acceptance(self._path(label, prompt), alpha)


def write_acceptance(path: Path, alpha: TokenAcceptance) -> None:
    """A measurement's tokens to safetensors atomically (a file renamed into place: a killed run leaves no half
    file); `exact` only when measured."""
    tensors = {"positions": alpha.positions, "topk": alpha.topk, "sequences": alpha.sequences}
    if alpha.exact is not None:
        tensors["exact"] = alpha.exact
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path)
