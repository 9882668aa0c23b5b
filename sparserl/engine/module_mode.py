"""A model in train or eval mode (dropout on or off) for the length of a block, its previous mode restored after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def module_mode(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    """`model.train(training)` inside the block (False: eval mode, as for sampling and scoring); afterwards the
    mode the model had before, even when the block raises."""
    was_training = model.training
    model.train(training)
    try:
        yield model
    finally:
        model.train(was_training)
