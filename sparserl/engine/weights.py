"""How the engine multiplies by the model's weights: through its modules, or through a packed copy.

`PackedProjections` copies each layer's q|k|v and gate|up projections into one matrix each, stored [in, out] in
the engine's compute dtype, with PEFT LoRA adapters merged in. On CPU, MKL multiplies a few rows by an [in, out]
matrix 1.3-2x faster than by the [out, in] weight `nn.Linear` keeps (batch 8-16, SmolLM2 shapes, one thread;
docs/engine.md), fusing halves the calls per layer, and the copy is where float32 master weights become the
bfloat16 the rollout runs in.

An optimizer step may change the weights without telling anyone (fused AdamW does not even bump a tensor's
version counter), so by default the copy is rebuilt at every `generate` call. A model whose trainer promises to
say when its weights move (`track_weights_version`, then `bump_weights_version` after every in-place update)
gets its copy cached instead (`packed_projections`): rebuilt only when the version, the LoRA merge state (which
adapters are active, enabled, merged, their scaling), a weight tensor's identity or its autograd version counter
moved, and shared by every engine over the model. The stale copy is dropped at the bump, not kept until the next
call.

An LM head marked by `keep_head_float32` (model.fp32_lm_head) multiplies in float32 whatever the compute dtype: the
packed copy keeps it in float32 and `head_logits` runs it so outside autocast, for the sampler and the scorer alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ModuleProjections:
    """Calls the model's own modules (their dtype, LoRA layers as PEFT runs them): the fallback, and CUDA's path
    when no dtype change is asked for (no second copy of the weights in GPU memory)."""

    def __init__(self, layers: nn.ModuleList, lm_head: nn.Module):
        self.layers, self.lm_head = layers, lm_head

    def qkv(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        attn = self.layers[layer].self_attn
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    def out(self, layer: int, x: Tensor) -> Tensor:
        return self.layers[layer].self_attn.o_proj(x)

    def mlp(self, layer: int, x: Tensor) -> Tensor:
        return self.layers[layer].mlp(x)

    def logits(self, x: Tensor) -> Tensor:
        return head_logits(self.lm_head, x)


@dataclass
class _Matrix:
    """x @ weight_t + bias, with weight_t [in, out] contiguous."""

    weight_t: Tensor
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.weight_t.dtype)
        y = (
            torch.mm(flat, self.weight_t)
            if self.bias is None
            else torch.addmm(self.bias, flat, self.weight_t)
        )
        return y.view(*x.shape[:-1], -1)


def linear_weight(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """The weight [out, in] and bias that an `nn.Linear`, or a PEFT LoRA Linear with its active adapters merged,
    applies; None for anything else (DoRA and other variants, quantised layers, a module with forward hooks)."""
    if module._forward_hooks or module._forward_pre_hooks:  # a hook may change what the module computes
        return None
    if type(module) is nn.Linear:
        return module.weight, module.bias
    base = getattr(module, "base_layer", None)
    if type(base) is not nn.Linear or not hasattr(module, "lora_A"):
        return None
    weight = base.weight
    if module.disable_adapters or module.merged:
        return weight, base.bias
    for name in module.active_adapters:
        if name in module.lora_A:
            if name in getattr(module, "lora_variant", {}):
                return None
            weight = weight + module.get_delta_weight(name)  # fp32 adapters promote a half base: no rounding
    return weight, base.bias


def _pack(modules: list[nn.Module], dtype: torch.dtype) -> _Matrix | None:
    found = [linear_weight(m) for m in modules]
    if any(f is None for f in found):
        return None
    weight = torch.cat([w for w, _ in found]).t().to(dtype).contiguous()
    biases = [b for _, b in found]
    if all(b is None for b in biases):
        return _Matrix(weight, None)
    bias = torch.cat(
        [b if b is not None else w.new_zeros(w.shape[0]) for (w, _), b in zip(found, biases, strict=True)]
    )
    return _Matrix(weight, bias.to(dtype))


class PackedProjections:
    """Fused, [in, out] copies of every projection and the LM head in `dtype` (see the module docstring)."""

    def __init__(self, qkv: list[_Matrix], out: list[_Matrix], gate_up: list[_Matrix], down: list[_Matrix],
                 lm_head: _Matrix, layers: nn.ModuleList):  # fmt: skip
        self._qkv, self._out, self._gate_up, self._down, self._lm_head = qkv, out, gate_up, down, lm_head
        self.splits = [(a.q_proj.out_features, a.k_proj.out_features) for a in (m.self_attn for m in layers)]
        self.act = [m.mlp.act_fn for m in layers]

    @classmethod
    def build(cls, layers: nn.ModuleList, lm_head: nn.Module, dtype: torch.dtype) -> PackedProjections | None:
        """Pack every layer, or None when a projection is not a plain (or LoRA) Linear."""
        parts: dict[str, list[_Matrix]] = {"qkv": [], "out": [], "gate_up": [], "down": []}
        for mod in layers:
            attn, mlp = mod.self_attn, mod.mlp
            if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                return None
            for name, group in (("qkv", [attn.q_proj, attn.k_proj, attn.v_proj]), ("out", [attn.o_proj]),
                                ("gate_up", [mlp.gate_proj, mlp.up_proj]), ("down", [mlp.down_proj])):  # fmt: skip
                matrix = _pack(group, dtype)
                if matrix is None:
                    return None
                parts[name].append(matrix)
        head = _pack([lm_head], head_dtype(lm_head, dtype))
        return None if head is None else cls(**parts, lm_head=head, layers=layers)

    def qkv(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q_size, kv_size = self.splits[layer]
        return self._qkv[layer](x).split((q_size, kv_size, kv_size), dim=-1)

    def out(self, layer: int, x: Tensor) -> Tensor:
        return self._out[layer](x)

    def mlp(self, layer: int, x: Tensor) -> Tensor:
        gate, up = self._gate_up[layer](x).chunk(2, dim=-1)
        return self._down[layer](self.act[layer](gate) * up)

    def logits(self, x: Tensor) -> Tensor:
        return self._lm_head(x)

    def nbytes(self) -> int:
        """Bytes of the packed copy's own storages (each counted once): what packing adds to the model's."""
        matrices = [*self._qkv, *self._out, *self._gate_up, *self._down, self._lm_head]
        tensors = [t for m in matrices for t in (m.weight_t, m.bias) if t is not None]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


# the attribute on an LM head that `keep_head_float32` sets: its matmul runs in float32 (model.fp32_lm_head)
FLOAT32_HEAD_ATTR = "sparserl_float32_head"


def keep_head_float32(lm_head: nn.Module) -> None:
    """Mark `lm_head` so that the engine's packed copy and `head_logits` multiply by it in float32 (its weight is
    left as it is: a tied embedding stays tied). ValueError for a head that is not a plain or LoRA Linear."""
    if linear_weight(lm_head) is None:
        raise ValueError(
            f"model.fp32_lm_head needs a plain or LoRA Linear LM head, not {type(lm_head).__name__} (or one "
            "with forward hooks)"
        )
    setattr(lm_head, FLOAT32_HEAD_ATTR, True)


def head_dtype(lm_head: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype the head multiplies in when the rest computes in `dtype`."""
    return torch.float32 if getattr(lm_head, FLOAT32_HEAD_ATTR, False) else dtype


def head_logits(lm_head: nn.Module, hidden: Tensor) -> Tensor:
    """`lm_head(hidden)`, or for a head marked by `keep_head_float32` the same Linear in float32 outside autocast
    (the input and the weight upcast; gradients flow back to both)."""
    if not getattr(lm_head, FLOAT32_HEAD_ATTR, False):
        return lm_head(hidden)
    found = linear_weight(lm_head)
    if found is None:  # marked, then given a hook or replaced: say so rather than multiply in half precision
        raise RuntimeError(
            f"the float32 LM head ({type(lm_head).__name__}) is no longer a plain or LoRA Linear"
        )
    weight, bias = found
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


# the attribute on the causal LM that holds its weights version; absent: nobody tracks it, repack every call
WEIGHTS_VERSION_ATTR = "sparserl_weights_version"
# causal LM -> (cache key, its packed copy or None when it cannot be packed); weak: no model is kept alive
_PACKED: weakref.WeakKeyDictionary[nn.Module, tuple[Hashable, PackedProjections | None]] = (
    weakref.WeakKeyDictionary()
)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def track_weights_version(model: nn.Module) -> None:
    """Promise that every in-place change of `model`'s weights that autograd does not see (an optimizer step:
    fused AdamW bumps no version counter) is followed by `bump_weights_version`; engines over it then keep their
    packed copy between calls. Without the promise they repack at every call."""
    lm = _unwrap(model)
    if getattr(lm, WEIGHTS_VERSION_ATTR, None) is None:
        setattr(lm, WEIGHTS_VERSION_ATTR, 0)


def bump_weights_version(model: nn.Module) -> None:
    """The weights of `model` changed in place: the next `generate` repacks. The stale copy is freed now."""
    lm = _unwrap(model)
    version = getattr(lm, WEIGHTS_VERSION_ATTR, None)
    if version is not None:
        setattr(lm, WEIGHTS_VERSION_ATTR, version + 1)
    _PACKED.pop(lm, None)


def weights_version(model: nn.Module) -> int | None:
    """The model's weights version, or None when nobody tracks it."""
    return getattr(_unwrap(model), WEIGHTS_VERSION_ATTR, None)


def _tensor_key(t: Tensor | None) -> tuple | None:
    return None if t is None else (id(t), t.data_ptr(), t._version, t.dtype, t.device)


def _module_key(module: nn.Module) -> tuple:
    """What `linear_weight(module)` depends on, besides values changed without a version bump."""
    hooks = bool(module._forward_hooks or module._forward_pre_hooks)
    base = getattr(module, "base_layer", None)
    if base is None or not hasattr(module, "lora_A"):
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        return type(module), hooks, _tensor_key(weight), _tensor_key(bias)
    lora_a, lora_b, variants = module.lora_A, module.lora_B, getattr(module, "lora_variant", {})
    adapters = tuple(
        (
            n,
            _tensor_key(lora_a[n].weight),
            _tensor_key(lora_b[n].weight),
            module.scaling.get(n),
            n in variants,
        )
        for n in module.active_adapters
        if n in lora_a
    )
    return (type(module), hooks, module.disable_adapters, module.merged, adapters,
            _tensor_key(base.weight), _tensor_key(base.bias))  # fmt: skip


def _projections(layers: nn.ModuleList, lm_head: nn.Module) -> list[nn.Module]:
    mods: list[nn.Module] = [lm_head]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        mods += [getattr(mlp, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
    return [m for m in mods if m is not None]


def packed_projections(
    model: nn.Module, layers: nn.ModuleList, lm_head: nn.Module, dtype: torch.dtype
) -> PackedProjections | None:
    """`PackedProjections.build`, cached per model when its weights version is tracked (`track_weights_version`):
    the cached copy is reused while the version, the dtype and every projection's state (`_module_key`) are
    unchanged, else dropped before the new one is built (never two copies at once)."""
    model = _unwrap(model)
    version = getattr(model, WEIGHTS_VERSION_ATTR, None)
    if version is None:
        return PackedProjections.build(layers, lm_head, dtype)
    key = (version, dtype, tuple(_module_key(m) for m in _projections(layers, lm_head)))
    hit = _PACKED.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    _PACKED.pop(model, None)
    packed = PackedProjections.build(layers, lm_head, dtype)
    _PACKED[model] = (key, packed)
    return packed


def drop_packed(model: nn.Module) -> None:
    """Free `model`'s cached packed copy (its memory) now; the next call repacks."""
    _PACKED.pop(_unwrap(model), None)


def holds_packed(model: nn.Module) -> bool:
    """Whether a packed copy of `model`'s weights is cached (and holds its memory) now."""
    return _unwrap(model) in _PACKED
