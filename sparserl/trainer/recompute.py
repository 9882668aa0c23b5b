"""What the learner's backward keeps and what it recomputes.

Selective recompute: a decoder layer's sub-modules (`optim.recompute_modules`, Megatron's name) run under
torch.utils.checkpoint while the learner trains, so that the backward recomputes their activations instead of
keeping them. Unlike whole-layer gradient checkpointing (transformers' own, `optim.gradient_checkpointing`), it
never reruns attention, so a group's shared prompt KV (engine/scoring.py) stays usable: recomputing an attention
block would append its keys and values to that cache a second time.

Elementwise recompute (`optim.recompute_modules` 'layernorm', 'mlp_act'): the outputs of cheap elementwise steps
that the next projections keep for their weights' gradients (the norms' outputs, the MLP's product) recomputed
in the backward from tensors kept anyway (`RecomputedSaves`): the same numbers bit for bit, a few elementwise
passes more in the backward (default run: 193 MiB less at the peak, the update's CPU time +7%).

Always on: a SiLU-gated MLP's `silu(gate) * up` keeps gate and up for the backward, not silu(gate) as well
(`fuse_gated_activations`): the same numbers bit for bit, one elementwise pass more in the backward."""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from sparserl.config import ConfigError


def _trains_with_grad(module: nn.Module) -> bool:
    """Whether `module` runs the learner's forward, the only one these bound forwards change (the sampler and the
    scoring passes run without grad)."""
    return module.training and torch.is_grad_enabled()


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's class forward, under a non-reentrant checkpoint while it trains with grad."""
    forward = type(self).forward
    if not _trains_with_grad(self):
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


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The gated MLP's product, as `_SiluMul` computes it and as the recompute of 'mlp_act' reruns it."""
    return F.silu(gate) * up


class _SiluMul(torch.autograd.Function):
    """`silu(gate) * up` keeping gate and up for the backward, where autograd's silu-then-multiply keeps
    silu(gate) too (one more [tokens, intermediate] tensor a layer: 10% of the default update's activations). The
    backward recomputes silu(gate) and runs autograd's own kernels in autograd's order: bit for bit its gradients."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return _silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[override]
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def _gated_mlp_forward(self: nn.Module, x: Tensor) -> Tensor:
    """A SiLU-gated MLP's forward (Llama, Mistral, Qwen2/3: down(silu(gate(x)) * up(x))) through `_SiluMul`
    while it trains with grad; its class forward otherwise. The product, which down_proj's LoRA (or weight)
    keeps for its gradient, is recomputed from gate and up in the backward when the layer recomputes saves."""
    if not _trains_with_grad(self):
        return type(self).forward(self, x)
    gate, up = self.gate_proj(x), self.up_proj(x)
    product = _SiluMul.apply(gate, up)
    saves = getattr(self, "_recomputed_saves", None)
    if saves is not None:
        saves.register(product, lambda: _silu_mul(gate, up))
    return self.down_proj(product)


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


class _Recipe:
    """A recipe and its result once run: every save of one output (a norm's output feeds q, k and v, each a base
    matmul and a LoRA) reruns it once. Held by those saves only, so the result lives from the first of their
    backwards to the last, a layer's worth."""

    __slots__ = ("fn", "value")

    def __init__(self, fn: Callable[[], Tensor]) -> None:
        self.fn, self.value = fn, None

    def run(self) -> Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.fn()
        return self.value


class RecomputedSaves:
    """Saved tensors that the backward recomputes instead of keeping: a module registers an output with a
    recipe that rebuilds it from tensors autograd keeps anyway (a norm's input, the MLP's gate and up); while
    `saving()` is active, autograd's pack hook replaces any save of that output (or a view of it: the 2-D view a
    LoRA's matmul keeps) by the recipe, and the unpack hook reruns it in the backward. The recipe runs the same
    kernels on the same inputs: the same numbers bit for bit. Entries hold a weak reference, so a storage freed
    and reused by another tensor is never mistaken for the output. torch's own checkpointing does this for
    whole regions by rerunning them; here only elementwise steps rerun, never a matmul (the default config with
    'layernorm' and 'mlp_act': the update's kept activations 820 -> 573 MiB, docs/engine.md)."""

    # sees every tensor the layers keep as it is: an outer pack hook does not (the innermost one runs alone);
    # set by `observing_kept` for memory accounting (benchmarks/memory.py, tests)
    observer: Callable[[Tensor], None] | None = None

    def __init__(self) -> None:
        self._recipes: dict[int, tuple[weakref.ref, _Recipe]] = {}
        self.recomputed = 0  # recipes rerun by backwards so far

    def register(self, out: Tensor, recipe: Callable[[], Tensor]) -> None:
        if out.is_contiguous() and out.storage_offset() == 0:  # what `_unpack` rebuilds views of
            self._recipes[out.untyped_storage().data_ptr()] = (weakref.ref(out), _Recipe(recipe))

    def _pack(self, t: Tensor) -> Any:
        entry = self._recipes.get(t.untyped_storage().data_ptr())
        base = entry[0]() if entry is not None else None
        if base is None or base.dtype != t.dtype:
            if RecomputedSaves.observer is not None:
                RecomputedSaves.observer(t)
            return t
        return entry[1], t.size(), t.stride(), t.storage_offset()

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        recipe, size, stride, offset = packed
        if recipe.value is None:
            self.recomputed += 1
        return recipe.run().as_strided(size, stride, offset)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Autograd's saves inside go through the recipes registered inside; none outlives it."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._recipes.clear()


@contextmanager
def observing_kept(observer: Callable[[Tensor], None]) -> Iterator[None]:
    """`observer` called with every tensor the decoder layers keep for the backward as it is (their own pack
    hook hides them from any outer one), inside."""
    RecomputedSaves.observer = observer
    try:
        yield
    finally:
        RecomputedSaves.observer = None


def _recomputing_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    """The norm's class forward; while it trains with grad its output is registered for recomputation from x
    (kept anyway: the norm's own backward needs it)."""
    out = type(self).forward(self, x)
    saves = getattr(self, "_recomputed_saves", None)
    if saves is not None and _trains_with_grad(self):
        saves.register(out, lambda: type(self).forward(self, x))
    return out


def _recomputing_layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The decoder layer's class forward, inside its `RecomputedSaves.saving()` while it trains with grad."""
    if not _trains_with_grad(self):
        return type(self).forward(self, *args, **kwargs)
    with self._recomputed_saves.saving():
        return type(self).forward(self, *args, **kwargs)


# the norms of the supported architectures whose forward is elementwise and deterministic (RMSNorm)
RECOMPUTED_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# optim.recompute_modules names whose recompute reruns elementwise steps only (Megatron's 'layernorm'; 'mlp_act'
# as its 'moe_act' for a dense gated MLP), against sub-modules rerun whole (`recompute_submodules`)
ELEMENTWISE_RECOMPUTE = ("layernorm", "mlp_act")


def recompute_cheap_saves(layers: nn.ModuleList, names: Sequence[str]) -> int:
    """`names` of ELEMENTWISE_RECOMPUTE recomputed in the backward (`RecomputedSaves`) in every decoder layer whose
    norms are `RECOMPUTED_NORMS`: 'layernorm', both norms' outputs; 'mlp_act', the MLP's product, once
    `fuse_gated_activations` bound it. Not with whole-layer checkpointing, whose own pack hook must stay innermost.
    Returns the number of layers set up (0 when none fits)."""
    done = 0
    for layer in layers:
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if not all(type(n).__name__ in RECOMPUTED_NORMS for n in norms):
            continue
        saves = RecomputedSaves()
        if "layernorm" in names:
            for norm in norms:
                norm._recomputed_saves = saves
                norm.forward = types.MethodType(_recomputing_norm_forward, norm)
        if "mlp_act" in names:
            layer.mlp._recomputed_saves = saves
        layer._recomputed_saves = saves
        layer.forward = types.MethodType(_recomputing_layer_forward, layer)
        done += 1
    return done
