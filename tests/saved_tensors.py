"""What a training forward keeps for its backward, for tests that compare two ways of running one."""

from __future__ import annotations

import torch
from torch import nn

from sparserl.engine.scoring import completion_logprobs
from sparserl.trainer.recompute import observing_kept


def kept_bytes(model: nn.Module, prompts: list[list[int]], completions: list[list[int]]) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for the backward of the completions'
    log-probs under `model` (inside decoder layers that recompute saves too: `observing_kept`)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observing_kept(pack):
        completion_logprobs(model, prompts, completions)
    return sum(kept.values())
