"""The engine's own forward pass over a Hugging Face decoder's modules, so that the KV cache and attention are ours.

Only the glue is ours: norms, embeddings, activations and the rotary tables are the model's own modules, and the
projections are the model's weights, either called through its modules or packed once per `generate` call
(`sparserl.engine.weights`): a weight update or an enabled adapter is seen by the next call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from sparserl.engine.weights import ModuleProjections, PackedProjections, packed_projections
from sparserl.models import check_supported


def causal_lm(model: nn.Module) -> PreTrainedModel:
    """The underlying `*ForCausalLM`, unwrapping a PEFT model (its LoRA layers stay in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def max_positions(model: nn.Module) -> int | None:
    """The positions the model was trained for (its config's max_position_embeddings; None when unsaid)."""
    return getattr(causal_lm(model).config, "max_position_embeddings", None)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class LayerQKV:
    """Post-RoPE queries [B, Hq, T, D], keys and values [B, Hkv, T, D] of one layer."""

    q: Tensor
    k: Tensor
    v: Tensor


class Decoder:
    """Runs a Llama/Mistral/Qwen2/Qwen3 decoder layer by layer, leaving attention to the caller.

    `dtype` is the compute dtype of the projections, attention and KV cache (default: the weights' own). The
    residual stream stays in the weights' dtype, as under autocast: bfloat16 matmuls over float32 master weights.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None):
        lm = causal_lm(model)
        check_supported(lm, getattr(lm.config, "name_or_path", "model") or "model")
        cfg = lm.config
        self.model = lm
        self.layers = lm.model.layers
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = max_positions(lm)
        self.scale = self.head_dim**-0.5
        self.dtype = dtype or self.model.lm_head.weight.dtype
        self.modules = ModuleProjections(self.layers, lm.lm_head)
        self.proj: ModuleProjections | PackedProjections = self.modules

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def prepare(self) -> None:
        """Read the current weights: pack them (CPU, or a compute dtype other than the weights'), else use the
        modules. Called at the start of every `generate`, since the weights may have changed since the last; a
        model whose weights version is tracked reuses its packed copy until it moves (`weights.packed_projections`)."""
        lm, weights_dtype = self.model, self.model.lm_head.weight.dtype
        packed = None
        if self.device.type == "cpu" or self.dtype != weights_dtype:
            packed = packed_projections(lm, self.layers, lm.lm_head, self.dtype)
        if packed is None and self.dtype != weights_dtype:
            raise NotImplementedError(
                f"rollouts in {self.dtype} over {weights_dtype} weights need plain or LoRA Linear projections; "
                f"{type(lm).__name__} has another kind (load the model in {self.dtype} instead)"
            )
        self.proj = packed or self.modules

    def release(self) -> None:
        """Drop this decoder's hold on the packed copy between calls (its memory, unless the model's weights
        version is tracked: then the copy stays cached for the next call at the same version)."""
        self.proj = self.modules

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.model.embed_tokens(input_ids)

    def rope(self, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin tables [B, T, D] for the true positions [B, T], in the compute dtype: a bfloat16 sampler rotates
        in bfloat16 (rotating in float32 did not narrow its gap to the scorer on SmolLM2: docs/results/rope_bf16.json)."""
        cos, sin = self.model.model.rotary_emb(hidden, positions)
        return cos.to(self.dtype), sin.to(self.dtype)

    def qkv(self, layer: int, hidden: Tensor, rope: tuple[Tensor, Tensor]) -> LayerQKV:
        attn = self.layers[layer].self_attn
        x = self.layers[layer].input_layernorm(hidden)
        b, t, _ = x.shape
        q, k, v = self.proj.qkv(layer, x)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before RoPE
            q, k = attn.q_norm(q).to(self.dtype), attn.k_norm(k).to(self.dtype)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # rotate in the tables' dtype (the compute dtype, see `rope`), then round to the compute dtype
        rotate = torch.promote_types(rope[0].dtype, self.dtype)
        cos, sin = (r.unsqueeze(1).to(rotate) for r in rope)
        q, k = q.to(rotate), k.to(rotate)
        return LayerQKV(
            (q * cos + rotate_half(q) * sin).to(self.dtype),
            (k * cos + rotate_half(k) * sin).to(self.dtype),
            v,
        )

    def finish_layer(self, layer: int, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """Output projection, residuals and MLP; `attn_out` is [B, Hq, T, D]."""
        b, _, t, _ = attn_out.shape
        hidden = hidden + self.proj.out(layer, attn_out.transpose(1, 2).reshape(b, t, -1))
        return hidden + self.proj.mlp(layer, self.layers[layer].post_attention_layernorm(hidden))

    def logits(self, hidden: Tensor) -> Tensor:
        return self.proj.logits(self.model.model.norm(hidden)).float()


def prefill_attention(qkv: LayerQKV, valid: Tensor) -> Tensor:
    """Causal attention over a right-padded batch; `valid` [B, T] marks real tokens.

    With right padding the causal mask alone hides every padding key from every real query (a row's padding
    only follows its tokens), so no padding mask is built: SDPA runs its fused causal kernel, with no [B, T, T]
    mask (1.5x faster on CPU at 1k tokens). Outputs at padding positions are meaningless and never read.
    """
    if valid.shape[1] > 1 and not bool((valid[:, :-1] >= valid[:, 1:]).all()):
        raise ValueError("prefill_attention: prompts must be right-padded (real tokens first in each row)")
    return nn.functional.scaled_dot_product_attention(qkv.q, qkv.k, qkv.v, is_causal=True, enable_gqa=True)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One query per row against its cached keys, grouped by KV head (no KV repetition).

    q [N, Hq, 1, D]; k, v [N, Hkv, S, D]; valid [N, S] or [N, Hkv, S]. Returns the output [N, Hq, 1, D] and
    the attention probabilities [N, Hkv, G, S] (G query heads per KV head), which eviction methods score with.
    """
    n, hq, _, d = q.shape
    hkv = k.shape[1]
    qg = q.view(n, hkv, hq // hkv, d) * scale  # scale the few queries rather than the many scores
    probs = masked_probs(torch.matmul(qg, k.transpose(-1, -2)), valid)
    out = torch.matmul(probs.to(v.dtype), v)
    return out.view(n, hq, 1, d), probs


def masked_probs(scores: Tensor, valid: Tensor) -> Tensor:
    """float32 softmax over the slots of scores [N, Hkv, G, S] (overwritten) where `valid` [N, S] or [N, Hkv, S]
    holds."""
    mask = valid[:, None, None, :] if valid.dim() == 2 else valid[:, :, None, :]
    return scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32)
