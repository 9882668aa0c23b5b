"""The tensors that travel between the trainer and its actors (rollout workers, learner ranks): the ones the
optimizer changes, by parameter name, and their copy into a model in place."""

from __future__ import annotations

import torch


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the optimizer changes (all of them without LoRA, the adapter with it), detached on the CPU."""
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def load_named(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` (parameter name -> tensor, as `trainable_state` gives) into the model's parameters in place."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
