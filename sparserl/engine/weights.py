"""How the engine multiplies by the model's weights: through its modules, or through a packed copy.

`PackedProjections` copies each layer's q|k|v and gate|up projections into one matrix each, stored [in, out] in
the engine's compute dtype, with PEFT LoRA adapters merged in. On CPU, MKL multiplies a few rows by an [in, out]
matrix 1.3-2x faster than by the [out, in] weight `nn.Linear` keeps (batch 8-16, SmolLM2 shapes, one thread;
docs/engine.md), fusing halves the calls per layer, and the copy is where float32 master weights become the
bfloat16 the rollout runs in. The copy is rebuilt at every `generate` call, because an optimizer step may change
the weights without telling anyone (fused AdamW does not even bump a tensor's version counter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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
        return self.lm_head(x)


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
        head = _pack([lm_head], dtype)
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
