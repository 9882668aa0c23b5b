"""Which torch device a `model.device` / `--device` setting stands for. Apart from sparserl.models because its
error is a ConfigError, and the config package imports the engine, which imports sparserl.models."""

from __future__ import annotations

import torch

from sparserl.config.errors import ConfigError


def resolve_device(name: str | None, key: str) -> str:
    """The torch device `name` stands for ('auto' or empty: cuda when available, else cpu). An unknown device, or
    one this machine lacks, is a ConfigError naming `key` (the flag or config key that chose it) before any model
    is loaded."""
    if not name or name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"{key} {name!r} is not a torch device (e.g. auto, cpu, cuda, cuda:1, mps)"
        ) from None
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}
    if device.type in available and not available[device.type]():
        raise ConfigError(f"{key} {name}: no {device.type} device on this machine; use cpu")
    return name
