"""Tests parametrised over a registry's contents (tests/test_conformance_*.py): a class registered is a class
tested. `Needs` says what building one class takes on one machine beyond its own setting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Needs:
    """What building a registered class on one machine takes beyond the setting that chooses it."""

    settings: tuple[str, ...] = ()
    slow: str = ""  # why its tests are marked slow ("": they are not)
    module: str = ""  # an optional package it imports: its tests are skipped without it

    def param(self, *values: Any, id: str) -> Any:
        """A test parameter for the class, marked slow where building it is."""
        return pytest.param(*values, marks=[pytest.mark.slow] if self.slow else [], id=id)

    def importable(self) -> None:
        """Skip the test, naming the package, where the class's optional package is not installed."""
        if self.module:
            pytest.importorskip(self.module)
