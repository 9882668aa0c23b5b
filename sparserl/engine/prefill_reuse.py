"""Reusing a prompt's dense prefill across calls that start from the same prompt.

A calibration measures each prompt under every candidate budget: the sampler's prefill (before any eviction or
page summary) and the dense scorer's prompt pass are the same computation each time, and for a long prompt they
are most of a unit's cost (an 8k-token prompt on SmolLM2, one CPU thread: 52 s sampling prefill + 62 s dense
scoring against 32 s for 128 decode steps). Inside `reusing_prefills()`, `RolloutEngine.prefilled` and
the scorer's shared prompt pass keep what they computed under a key of everything it depends on and hand out
copies of it, so the numbers are the same bit for bit and the caller's later changes never reach the kept one.

The caller promises that the model's weights do not change inside the scope (a calibration does not train); a
pass with grad enabled (the learner's) never reuses. Memory: one kept prefill per distinct key, dropped when the
scope ends; scope one prompt at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

T = TypeVar("T")

_KEPT: ContextVar[dict[Hashable, object] | None] = ContextVar("sparserl_kept_prefills", default=None)


@contextmanager
def reusing_prefills() -> Iterator[None]:
    """Within this scope, prefills of the same input by the same model are computed once (see the module). A
    scope inside another is the outer one: what is kept lives until the outermost scope ends."""
    if _KEPT.get() is not None:
        yield
        return
    token = _KEPT.set({})
    try:
        yield
    finally:
        _KEPT.reset(token)


def reused(key: Hashable, compute: Callable[[], T], copy: Callable[[T], T]) -> T:
    """`compute()`, or inside `reusing_prefills()` (and without grad) a `copy` of what it returned the first time
    under `key`; the kept value itself is never handed out."""
    kept = _KEPT.get()
    if kept is None or torch.is_grad_enabled():
        return compute()
    if key not in kept:
        kept[key] = compute()
    return copy(kept[key])
