"""What the learner's backward keeps and what it recomputes.

Selective recompute: a decoder layer's sub-modules (`optim.recompute_modules`, Megatron's name) run under
torch.utils.checkpoint while the learner trains, so that the backward recomputes their activations instead of
keeping them. Unlike whole-layer gradient checkpointing (transformers' own, `optim.gradient_checkpointing`), it
never reruns attention, so a group's shared prompt KV (engine/scoring.py) stays usable: recomputing an attention
block would append its keys and values to that cache a second time.

Always on: a SiLU-gated MLP's `silu(gate) * up` keeps gate and up for the backward, not silu(gate) as well
(`fuse_gated_activations`): the same numbers bit for bit, one elementwise pass more in the backward."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
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


class _SiluMul(torch.autograd.Function):
    """`silu(gate) * up` keeping gate and up for the backward, where autograd's silu-then-multiply keeps
    silu(gate) too (one more [tokens, intermediate] tensor a layer: 10% of the default update's activations). The
    backward recomputes silu(gate) and runs autograd's own kernels in autograd's order: bit for bit its gradients."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def _gated_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """A SiLU-gated MLP's forward (Llama, Mistral, Qwen2/3: down(silu(gate(x)) * up(x))) through `_SiluMul`
    while it trains with grad; its class forward otherwise."""
    if not (self.training and torch.is_grad_enabled()):
        return type(self).forward(self, x)
    return self.down_proj(_SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


# the MLP classes of the supported architectures (models.SUPPORTED_ARCHS) whose forward is exactly
# down_proj(act_fn(gate_proj(x)) * up_proj(x)) in the transformers versions pyproject allows
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


def fuse_gated_activations(layers: nn.ModuleList) -> bool:
    """Every layer's MLP through `_gated_mlp_forward` when all of them are `GATED_MLPS` with a SiLU activation
    (bound per module, as `recompute_submodules`, which runs the class forward under its checkpoint and so takes
    precedence). Returns whether it did; any other MLP is left as it is."""
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not mlps or not all(
        type(m).__name__ in GATED_MLPS
        and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        for m in mlps
    ):
        return False
    for m in mlps:
        m.forward = types.MethodType(_gated_mlp_forward, m)
    return True
