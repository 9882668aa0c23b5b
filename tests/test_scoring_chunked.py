"""The chunked log-softmax gather (`chunked_head.target_logprobs`) and the no-grad scorer: the same numbers, bit
for bit, as the whole [B, T, V] log-softmax and as the learner's grad path."""

from __future__ import annotations

import pytest
import torch
from test_engine import chat

from sparserl.engine import chunked_head, completion_logprobs, score
from sparserl.models import tiny_model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 5, 256])
def test_target_logprobs_equal_the_whole_log_softmax_bit_for_bit(monkeypatch, temperature, chunk):
    monkeypatch.setattr(chunked_head, "TARGET_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 1000, generator=gen) * 8
    targets = torch.randint(0, 1000, (3, 7), generator=gen)
    whole = (logits / temperature).log_softmax(dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.equal(chunked_head.target_logprobs(logits, targets, temperature), whole)


@pytest.mark.parametrize("chunk", [2, 256])
def test_no_grad_scoring_matches_the_grad_path_bit_for_bit(monkeypatch, chunk):
    monkeypatch.setattr(chunked_head, "TARGET_CHUNK", chunk)
    model, tok = tiny_model("llama", seed=0)
    group, other = chat(tok, "a shared prompt"), chat(tok, "another one, longer than the first")
    prompts = [group, group, other, group]
    completions = [[40, 41, 42], [43, 44], [45, 46, 47, 48, 49], [52]]
    grad_logp, grad_mask = completion_logprobs(model, prompts, completions, temperature=0.8)  # unchunked
    with torch.no_grad():
        logp, mask = completion_logprobs(model, prompts, completions, temperature=0.8)  # chunked
    assert torch.equal(logp, grad_logp.detach()) and torch.equal(mask, grad_mask)
    rows = score(model, prompts, completions, temperature=0.8)
    for i, c in enumerate(completions):
        assert torch.equal(rows[i], grad_logp[i, : len(c)].detach())
