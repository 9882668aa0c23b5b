"""Teacher-forced log-probs of completions under a model with dense attention (old, reference and learner), and,
on request, the dense next-token distributions at every completion position (the acceptance rate's dense side)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from sparserl.engine.decoder import causal_lm
from sparserl.engine.sampling import (
    TokenDistributions,
    check_distribution_request,
    distributions_of,
    processed_logprobs,
)


def _completion_logits(
    model: nn.Module, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> tuple[Tensor, Tensor, Tensor]:
    """Logits [B, T, V] predicting each completion token from its prompt and the tokens before it, the targets
    [B, T] and the mask [B, T]. T is the longest completion; rows are right-padded (mask 0)."""
    lm = causal_lm(model)
    device = lm.lm_head.weight.device
    b = len(prompt_ids)
    lens_p = [len(p) for p in prompt_ids]
    lens_c = [len(c) for c in completion_ids]
    t_c = max(max(lens_c), 1)
    width = max(lp + lc for lp, lc in zip(lens_p, lens_c, strict=True))
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    gather_pos = torch.zeros(b, t_c, dtype=torch.long)
    targets = torch.zeros(b, t_c, dtype=torch.long)
    mask = torch.zeros(b, t_c, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        row = list(p) + list(c)
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        gather_pos[i, : len(c)] = torch.arange(len(p) - 1, len(p) + len(c) - 1)
        targets[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        mask[i, : len(c)] = True
    ids, attn, gather_pos, targets, mask = (x.to(device) for x in (ids, attn, gather_pos, targets, mask))
    hidden = lm.model(input_ids=ids, attention_mask=attn).last_hidden_state
    hidden = hidden.gather(1, gather_pos[..., None].expand(-1, -1, hidden.shape[-1]))
    return lm.lm_head(hidden).float(), targets, mask


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, ...]:
    """Differentiable per-token log-probs `logp` [B, T] of each completion given its prompt, and `mask` [B, T].

    T is the longest completion; rows are right-padded (mask 0). With `with_entropy`, also the entropy [B, T] of
    each position's distribution (after temperature).
    """
    logits, targets, mask = _completion_logits(model, prompt_ids, completion_ids)
    logp_all = (logits / temperature).log_softmax(dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1) * mask
    if not with_entropy:
        return logp, mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, mask, entropy


def micro_batches(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], token_budget: int
) -> Iterator[list[int]]:
    """Indices of the completions, shortest first, in chunks of at most `token_budget` padded tokens (at least
    one completion per chunk)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    width = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    order = sorted(range(len(width)), key=width.__getitem__)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and width[order[end]] * (end - start + 1) <= token_budget:
            end += 1
        yield order[start:end]
        start = end


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off while scoring; the model's mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def score(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    token_budget: int = 8192,
) -> list[Tensor]:
    """Per-token log-probs (float32, CPU) of each completion, micro-batched to `token_budget` padded tokens."""
    out: list[Tensor | None] = [None] * len(prompt_ids)
    with _eval_mode(model):
        for chunk in micro_batches(prompt_ids, completion_ids, token_budget):
            logp, _ = completion_logprobs(
                model, [prompt_ids[i] for i in chunk], [completion_ids[i] for i in chunk], temperature
            )
            for row, i in enumerate(chunk):
                out[i] = logp[row, : len(completion_ids[i])].float().cpu()
    return out  # type: ignore[return-value]


@torch.no_grad()
def score_distributions(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    top_logprobs: int = 20,
    full_logprobs: bool = False,
    token_budget: int = 8192,
) -> list[TokenDistributions]:
    """The dense policy's next-token distribution at every position of each completion (the prefix the sampler
    saw for that token), processed like the sampler's (temperature, top-k, top-p; `sampling.processed_logprobs`):
    its `top_logprobs` most likely ids and log-probs [T, k], and all log-probs [T, V] with `full_logprobs`
    (4 bytes x V per token). Micro-batched to `token_budget` padded tokens."""
    check_distribution_request(top_logprobs, causal_lm(model).lm_head.out_features, "score_distributions")
    out: list[TokenDistributions | None] = [None] * len(prompt_ids)
    with _eval_mode(model):
        for chunk in micro_batches(prompt_ids, completion_ids, token_budget):
            logits, _, _ = _completion_logits(
                model, [prompt_ids[i] for i in chunk], [completion_ids[i] for i in chunk]
            )
            for row, i in enumerate(chunk):
                logp = processed_logprobs(logits[row, : len(completion_ids[i])], temperature, top_p, top_k)
                out[i] = distributions_of(logp, top_logprobs, full_logprobs)
    return out  # type: ignore[return-value]
