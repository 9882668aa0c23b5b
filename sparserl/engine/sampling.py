"""Next-token sampling that reports the log-probability under the distribution actually sampled from."""

from __future__ import annotations

import torch
from torch import Tensor


def processed_logprobs(
    logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> Tensor:
    """Log-probs [N, V] after temperature, top-k and top-p (removed tokens get -inf)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass of the tokens ranked above it already reaches top_p
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(dim=-1)


def sample_next(
    logits: Tensor,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[Tensor, Tensor]:
    """Sampled tokens [N] and their log-probs [N]; temperature 0 is greedy (log-prob 0: a point mass)."""
    if temperature <= 0:
        return logits.argmax(dim=-1), torch.zeros(logits.shape[0], device=logits.device)
    logp = processed_logprobs(logits, temperature, top_p, top_k)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
