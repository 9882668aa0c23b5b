"""Selective recompute: a decoder layer's sub-modules (`optim.recompute_modules`, Megatron's name) run under
torch.utils.checkpoint while the learner trains, so that the backward recomputes their activations instead of
keeping them. Unlike whole-layer gradient checkpointing (transformers' own, `optim.gradient_checkpointing`), it
never reruns attention, so a group's shared prompt KV (engine/scoring.py) stays usable: recomputing an attention
block would append its keys and values to that cache a second time."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sparserl.config import ConfigError


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's class forward, under a non-reentrant checkpoint while it trains with grad (as is otherwise:
    the sampler and the scoring passes run without grad)."""
    forward = type(self).forward
    if not (self.training and torch.is_grad_enabled()):
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def recompute_submodules(layers: nn.ModuleList, names: Sequence[str]) -> None:
    """Every layer's sub-modules `names` (config's RECOMPUTE_MODULES: 'mlp', the feed-forward block, whose gate,
    up, activation and product tensors, four of [tokens, intermediate] a layer, are most of what the backward
    keeps) recomputed in the backward. Bound as a method of each sub-module, so that a deep copy of the model (a
    sampler's replica) binds its own. A model whose layers lack one is a ConfigError naming the setting."""
    for layer in layers:
        for name in names:
            sub = getattr(layer, name, None)
            if not isinstance(sub, nn.Module):
                raise ConfigError(
                    f"optim.recompute_modules names {name!r}, which this model's decoder layers "
                    f"({type(layer).__name__}) do not have"
                )
            sub.forward = types.MethodType(_checkpointed_forward, sub)


def enable_activation_checkpointing(lm: Any) -> None:
    """transformers' whole-layer checkpointing, non-reentrant (it works with a frozen base: LoRA), under the name
    of the installed version (`activation_checkpointing_enable` since 5.x, `gradient_checkpointing_enable`
    before, deprecated after)."""
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
