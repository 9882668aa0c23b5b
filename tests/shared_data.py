"""The shared data folder some tests read (gsm8k, MATH and the Sparse-RL eval sets as .jsonl files): a checkout
beside it finds it at ../shared/data, a clone has none. Those tests carry the `shared_data` marker and skip,
naming the folder, where it is absent (conftest.py); the CI runs them where it exists."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
