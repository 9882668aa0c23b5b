"""Length schedules: the KV budget as a non-decreasing step function of a sequence's current total length.

A schedule is a table of bins `[[from_length, budget], ...]`: from total length `from_length` (prompt + generated
tokens, the newest included) on, the budget is `budget`, until the next bin starts. The first bin starts at 0, the
starts increase and the budgets never decrease. It is given inline or as a JSON/YAML file holding the table (or a
mapping whose `schedule` key holds it, so that a calibration can store its settings beside the table).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

from sparserl.errors import UserError

MAX_LENGTH = 2**31 - 1  # positions of a sequence: far beyond any model's context, within every index dtype


@dataclass(frozen=True)
class BudgetSchedule:
    """Bins of a length schedule: `starts[i]` is where bin i begins, `budgets[i]` its budget."""

    starts: tuple[int, ...]
    budgets: tuple[int, ...]

    @classmethod
    def constant(cls, budget: int) -> BudgetSchedule:
        """One bin: the same budget at every length."""
        return cls((0,), (budget,))

    @classmethod
    def from_table(cls, table: list[list[int]]) -> BudgetSchedule:
        """From a table already checked by `parse_schedule`."""
        return cls(tuple(start for start, _ in table), tuple(budget for _, budget in table))

    @property
    def largest(self) -> int:
        """The budget of the last bin, the largest one (the schedule is non-decreasing)."""
        return self.budgets[-1]

    def budget(self, length: Tensor) -> Tensor:
        """The budget [rows] of each sequence from its current total length [rows], in one lookup."""
        starts = torch.tensor(self.starts, dtype=length.dtype, device=length.device)
        budgets = torch.tensor(self.budgets, dtype=torch.long, device=length.device)
        return budgets[torch.searchsorted(starts, length, right=True) - 1]


def parse_schedule(value: Any, key: str = "kv.schedule", method: str | None = None) -> list[list[int]] | None:
    """A checked table `[[from_length, budget], ...]` from an inline table, its YAML text, or a JSON/YAML file
    path; None (or 'null'/'none') means no schedule. Bad input raises UserError naming `key` (and the file).
    A mapping's `method` (what `sparserl calibrate` calibrated it for) other than `method` (the one it will
    be used with) is warned about: budgets calibrated for one method need not suit another."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none")):
        return None
    where = key
    if isinstance(value, str):
        text = value.strip()
        if not text:
            raise UserError(
                f"{key} is empty: give a table [[from_length, budget], ...] or a file holding one"
            )
        if text.startswith("["):
            value = _load_yaml(text, f"{key}={text!r}")
        else:
            where = f"{key} (file {text})"
            value = _load_file(Path(text).expanduser(), key)
    if isinstance(value, dict) and "schedule" in value:
        _check_method(value.get("method"), method, where)
        value = value["schedule"]
    return _check_table(value, where)


def _check_method(calibrated: Any, method: str | None, where: str) -> None:
    """Warn when a schedule calibrated for the method `calibrated` is used with another `method`."""
    if calibrated is None or method is None or calibrated == method:
        return
    warnings.warn(
        f"{where} was calibrated for method {calibrated!r} but is used with {method!r}: its budgets may "
        f"not suit {method}; calibrate one for it (sparserl calibrate --method {method})",
        UserWarning,
        stacklevel=3,
    )


def _load_yaml(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"{where}: not a valid table: {str(e).splitlines()[0]}") from None


def _load_file(path: Path, key: str) -> Any:
    """The parsed contents of a schedule file (.json as JSON, anything else as YAML)."""
    if path.is_dir():
        raise UserError(f"{key}: {path} is a directory; give a schedule file (JSON/YAML) or a table")
    if not path.is_file():
        raise UserError(f"{key}: the schedule file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{key}: {path} is not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset {e.start})"
        ) from None
    except OSError as e:
        raise UserError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{key}: {path} is not valid JSON: {e}") from None
    return _load_yaml(text, f"{key}: {path}")


def _check_table(table: Any, where: str) -> list[list[int]]:
    """The table as [[int, int], ...] if it is a non-empty, increasing, non-decreasing schedule."""
    if not isinstance(table, (list, tuple)):
        raise UserError(f"{where}: expected a table [[from_length, budget], ...], got {table!r}")
    if not table:
        raise UserError(f"{where} is empty: give at least one bin [0, budget]")
    rows: list[list[int]] = []
    for i, entry in enumerate(table):
        pair = list(entry) if isinstance(entry, (list, tuple)) else None
        if pair is None or len(pair) != 2 or not all(_is_int(x) for x in pair):
            raise UserError(
                f"{where}: bin {i} is {entry!r}; each bin is a pair [from_length, budget] of integers"
            )
        start, budget = int(pair[0]), int(pair[1])
        if start > MAX_LENGTH or budget > MAX_LENGTH:
            raise UserError(
                f"{where}: bin {i} is {entry!r}; lengths and budgets are at most {MAX_LENGTH:,} positions"
            )
        if budget < 1:
            raise UserError(f"{where}: bin {i} (from length {start}) has budget {budget}; budgets are >= 1")
        if i == 0 and start != 0:
            raise UserError(f"{where}: bin 0 starts at length {start}; the first bin must start at 0")
        if rows and start <= rows[-1][0]:
            raise UserError(
                f"{where}: bin {i} starts at length {start}, not after bin {i - 1} ({rows[-1][0]}); "
                "bin starts must increase"
            )
        if rows and budget < rows[-1][1]:
            raise UserError(
                f"{where}: bin {i} (from length {start}) has budget {budget}, below bin {i - 1}'s "
                f"{rows[-1][1]}; a schedule must be non-decreasing"
            )
        rows.append([start, budget])
    return rows


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or isinstance(x, float) and x.is_integer()
