"""experiments/p5_stability_v2.py's decision rule on hand-made tokens: equivalent inside the margin, moved
outside it, inconclusive when the interval straddles it, and no verdict for a bin with too few sequences."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

import p5_stability_v2 as X  # noqa: E402


def tokens(seed: int, shift: float, sequences: int = 64, spread: float = 0.3) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = 20
    return {
        "positions": torch.arange(per).repeat(sequences) + 64,  # bin 2 (64-95) for bins of 32
        "exact": torch.rand(sequences * per, generator=g) * spread + 0.7 + shift,
        "sequences": torch.arange(sequences).repeat_interleave(per),
    }


def test_verdicts_follow_the_margin():
    base = tokens(0, 0.0)
    assert X.delta(base, tokens(1, 0.0), 2)["verdict"] == "equivalent"
    moved = X.delta(base, tokens(1, 0.1), 2)
    assert moved["verdict"] == "moved" and moved["interval90"][0] > X.MARGIN
    wide = X.delta(tokens(0, 0.0, spread=0.9), tokens(1, 0.02, spread=0.9), 2)  # noisy tails: straddles 0.03
    assert wide["verdict"] == "inconclusive", wide
    assert X.delta(tokens(0, 0.0, sequences=16), base, 2) is None  # fewer than 32 sequences: no verdict
