"""Teacher-forced log-probs of completions under a model with dense attention (old, reference and learner)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from sparserl.engine.decoder import causal_lm


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
    logp_all = (lm.lm_head(hidden).float() / temperature).log_softmax(dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1) * mask
    if not with_entropy:
        return logp, mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, mask, entropy


@torch.no_grad()
def score(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    token_budget: int = 8192,
) -> list[Tensor]:
    """Per-token log-probs (float32, CPU) of each completion, micro-batched to `token_budget` padded tokens."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))
    out: list[Tensor | None] = [None] * len(order)
    was_training = model.training
    model.eval()
    try:
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order):
                width = len(prompt_ids[order[end]]) + len(completion_ids[order[end]])
                if width * (end - start + 1) > token_budget:
                    break
                end += 1
            chunk = order[start:end]
            logp, _ = completion_logprobs(
                model, [prompt_ids[i] for i in chunk], [completion_ids[i] for i in chunk], temperature
            )
            for row, i in enumerate(chunk):
                out[i] = logp[row, : len(completion_ids[i])].float().cpu()
            start = end
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]
