"""DeepSeek-V3.2's keep-sampling mask: the sampler's top-p / top-k truncation applied to the learner's
distributions, so that pi_theta, pi_old (and the reference) are renormalised over the same kept set of tokens the
sampler drew from (its recorded log-probs already are) and the importance ratio compares like with like. Without
it, a truncating sampler's log-prob of a token exceeds the learner's by the log of the mass the learner puts on
the kept set, a bias the corrections read as mismatch.

The sampler records each token's kept set as bits (`pack_kept`: V / 8 bytes a token, 6 KiB for SmolLM2's 49,152
ids); the learner's log-softmax runs over the kept ids only (`engine.chunked_head.target_logprobs`), which is
`keep_sampling_logprobs` below, chunked. A token whose kept set is that token alone gets log-prob 0 and no
gradient (`keep_sampling/single_token_frac` counts them).
"""

from __future__ import annotations

import torch
from torch import Tensor

_SHIFTS = torch.arange(8, dtype=torch.uint8)
_POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int32)


def truncates(top_p: float, top_k: int) -> bool:
    """True when the sampler removes tokens (top-p below 1 or a top-k), i.e. when the mask changes anything."""
    return top_p < 1.0 or top_k > 0


def pack_kept(logp: Tensor) -> Tensor:
    """The support of distributions [..., V] (the ids with mass) as bits, uint8 [..., ceil(V / 8)]: bit j of
    byte b is id 8b + j."""
    kept = logp > float("-inf")
    pad = (-kept.shape[-1]) % 8
    if pad:
        kept = torch.nn.functional.pad(kept, (0, pad))
    bits = kept.view(*kept.shape[:-1], -1, 8).to(torch.uint8) << _SHIFTS.to(kept.device)
    return bits.sum(dim=-1, dtype=torch.uint8)


def unpack_kept(packed: Tensor, vocab: int) -> Tensor:
    """`pack_kept`'s bits [..., ceil(V / 8)] back to a bool mask [..., V]."""
    bits = (packed[..., None] >> _SHIFTS.to(packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :vocab].bool()


def padded_kept(rows: list[Tensor], lengths: list[int], width: int) -> Tensor:
    """The kept sets of a batch, uint8 [B, width, bytes]: each sample's tokens (one kept set per token of its
    `lengths`, checked), then all ids kept (padding keeps every id, so that its log-softmax stays finite)."""
    out = torch.full((len(rows), width, rows[0].shape[-1]), 255, dtype=torch.uint8)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        if len(row) != n:
            raise RuntimeError(f"keep-sampling mask: sample {i}: {len(row)} kept sets for {n} tokens")
        out[i, :n] = row
    return out


def keep_sampling_logprobs(logits: Tensor, kept: Tensor, tokens: Tensor) -> Tensor:
    """log pi(o_t) renormalised over the kept set: log_softmax of `logits` [..., V] (after the sampler's
    temperature) with the ids outside `kept` (bool [..., V]) at -inf, taken at `tokens` [...]; -inf for a token
    outside it."""
    masked = logits.float().masked_fill(~kept, float("-inf"))
    return masked.log_softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def kept_set_metrics(kept: Tensor, mask: Tensor) -> dict[str, float]:
    """`keep_sampling/kept_tokens_mean` (the mean size of the sampler's kept set over trained tokens) and
    `keep_sampling/single_token_frac` (the share whose kept set is one token: log-prob 0, no gradient), for
    packed kept sets [B, T, bytes] and the response mask [B, T]."""
    sizes = _POPCOUNT[kept.long()].sum(dim=-1)[mask.bool()].float()
    if sizes.numel() == 0:
        return {}
    return {
        "keep_sampling/kept_tokens_mean": float(sizes.mean()),
        "keep_sampling/single_token_frac": float((sizes == 1).float().mean()),
    }
