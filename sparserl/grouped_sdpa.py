"""Teacher-forced passes of a grouped-query model read its KV heads in place on CPU, never repeated per query head.

transformers' `sdpa` attention repeats each KV head to its query heads whenever a mask is given (on CUDA, SDPA's
fused kernels take grouped heads only without a mask). torch's CPU flash kernel takes grouped heads and a mask
(`enable_gqa`, torch >= 2.5), so on CPU the repeat only costs: the update keeps the repeated keys and values for
its backward (SmolLM2-135M, 3 KV heads for 9 query heads: 3x the bytes), and the kernel reads them 3x. Same
outputs bit for bit; key and value gradients sum the heads' shares in another order (tests/test_grouped_sdpa.py).

`use_grouped_sdpa(model)` switches a model on `sdpa` with grouped KV heads to `GROUPED_SDPA`, which runs the
CPU case itself and hands every other case (CUDA, a position bias, an unmasked crop, ...) to transformers'.
The rollout engine runs its own attention (engine/decoder.py) and is not affected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPED_SDPA = "sparserl_grouped_sdpa"
_TORCH_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa


def grouped_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: query [B, Hq, T, D], key and value [B, Hkv, S, D] -> output
    [B, T, Hq, D] and no attention weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    plain = not (kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    # transformers crops the keys of an unmasked causal pass (an empty static cache's prefill): its case, not ours
    cropped = attention_mask is None and key.shape[2] != q_len
    # a model is switched only where torch has enable_gqa (`use_grouped_sdpa`)
    if not (query.device.type == "cpu" and query.shape[1] != key.shape[1] and plain) or cropped:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(causal and attention_mask is None and q_len > 1),
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch `model` from transformers' `sdpa` to `GROUPED_SDPA` when it has grouped KV heads; True if switched.
    Models on another attention (eager, flash, flex), without grouped heads, or on a transformers without
    `set_attn_implementation` are left as they are."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "_attn_implementation", None) != "sdpa" or not heads or kv_heads == heads:
        return False
    if not (_TORCH_HAS_GQA and hasattr(model, "set_attn_implementation") and _REGISTERED):
        return False
    model.set_attn_implementation(GROUPED_SDPA)
    return True


def _register() -> bool:
    """Register `GROUPED_SDPA` with transformers (the attention function and sdpa's mask); False where this
    transformers has no such registries. Done on import: a process that receives a switched model (a Ray
    learner rank, a rollout worker) runs it after importing sparserl, never having switched one itself."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    return True


_REGISTERED = _register()
