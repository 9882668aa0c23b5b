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


def _at_one_thread():
    """Tiny models run fastest on one thread, and several threads thrash on a busy shared CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_module():
    """Module fixtures are set up before a test's own fixtures, so they run at one thread too: a module
    fixture that trained at 2 threads summed in another order than its tests' one-thread runs (a learner
    compared with 2 ranks moved a weight by 3.9e-6 after one Adam step on CI)."""
    yield from _at_one_thread()


@pytest.fixture(autouse=True)
def one_thread():
    """Every test at one thread (`_at_one_thread`)."""
    yield from _at_one_thread()
