"""Byte sizes as people write them ('4GiB', '512 MiB', '8GB', '4G', 1000) and back: one parser for every
option that takes a memory size (`rollout.kv_memory_cap`, `sparserl cost --mem-cap`)."""

from __future__ import annotations

import re

# powers of 1000 for KB/MB/..., of 1024 for KiB/MiB/... and for the bare K/M/G/T
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {unit: 2 ** (10 * (i + 1)) for i, unit in enumerate(("k", "m", "g", "t"))}
UNITS |= {f"{unit}ib": 2 ** (10 * (i + 1)) for i, unit in enumerate(("k", "m", "g", "t"))}


def size_in_bytes(value: str | int | float) -> int:
    """Bytes in `value` (a number of bytes, or a number and a unit); ValueError when it is not a size. The
    result may be 0 or negative for such numbers: callers that need a positive size check it."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise ValueError(f"{value!r} is not a size")
    return int(float(match.group(1)) * UNITS[unit])


def format_size(n: float) -> str:
    """'1.50 GiB', '512 B': powers of 1024, two decimals above bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
