"""Shared test settings."""

from __future__ import annotations

import pytest
import torch

from tests.shared_data import DATA


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked shared_data, saying what is missing, where the shared data folder is absent."""
    if item.get_closest_marker("shared_data") is not None and not DATA.is_dir():
        pytest.skip(
            f"needs the shared data folder {DATA} (gsm8k, MATH, eval .jsonl files), absent in a clone"
        )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and several threads thrash on a busy shared CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
