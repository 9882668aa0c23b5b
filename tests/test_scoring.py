"""The dense scorer's shared-prompt forward: rows of one prompt run its prefix once, with the same log-probs and
gradients as one forward per row."""

from __future__ import annotations

import pytest
import torch
from test_engine import BATCH_TOL, chat

from sparserl.engine import completion_logprobs, score
from sparserl.engine.scoring import micro_batches
from sparserl.models import tiny_model


def grads_of(model, prompts, completions) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad()
    logp, mask = completion_logprobs(model, prompts, completions)
    logp.sum().backward()
    return logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_rows_sharing_a_prompt_score_like_one_forward_per_row():
    model, tok = tiny_model("llama", seed=0)
    group, other = chat(tok, "a shared prompt"), chat(tok, "another one, longer than the first")
    completions = [[40, 41, 42], [43, 44], [45, 46, 47, 48, 49], [50, 51], [52]]
    prompts = [group, group, other, group, other]
    shared, shared_grad = grads_of(model, prompts, completions)
    rows = [
        grads_of(model, [p], [c]) for p, c in zip(prompts, completions, strict=True)
    ]  # one prompt each: no sharing
    for i, (logp, _) in enumerate(rows):
        assert (shared[i, : len(completions[i])] - logp[0]).abs().max() < BATCH_TOL
        assert (shared[i, len(completions[i]) :] == 0).all()  # padding stays masked out
    per_row_grad = torch.stack([g for _, g in rows]).sum(0)
    # rounding only: measured max |diff| 1.1e-5 with gradients up to 16 in size (7e-7 of the largest)
    assert (shared_grad - per_row_grad).abs().max() < 1e-5 * per_row_grad.abs().max()
    # the check can fail: a completion scored after the wrong prompt differs by far more
    wrong, _ = grads_of(model, [other], [completions[0]])
    assert (shared[0, :3] - wrong[0]).abs().max() > 1e-2


def test_micro_batches_keep_every_row_once():
    prompts, completions = [[1, 2]] * 5, [[3] * k for k in (4, 1, 3, 2, 5)]
    chunks = list(micro_batches(prompts, completions, token_budget=12))
    assert sorted(i for c in chunks for i in c) == list(range(5))


def test_micro_batches_count_a_shared_prompt_once():
    """Rows of one long prompt share a chunk when its passes fit the budget (the prompt once, then every row's
    completion), though each whole row alone nearly fills it; per row, they go one a chunk."""
    prompts, completions = [list(range(100))] * 4, [[7] * 5] * 4
    assert list(micro_batches(prompts, completions, token_budget=128)) == [[0, 1, 2, 3]]
    assert len(list(micro_batches(prompts, completions, 128, shared_prompts=False))) == 4
    # the prompt KV repeated to the rows is bounded: 5 rows x 100 positions / SHARED_KV_PER_TOKEN (4) <= 128
    many = list(micro_batches([list(range(100))] * 64, [[7] * 5] * 64, token_budget=128))
    assert max(len(c) for c in many) == 5 and sorted(i for c in many for i in c) == list(range(64))
    # every row's completion is padded to the chunk's longest (its logits): a long one is counted for all rows
    mixed = list(micro_batches([list(range(100))] * 8 + [list(range(10))], [[7] * 10] * 8 + [[7] * 100], 256))
    assert all(len(c) * 101 <= 256 for c in mixed if 8 in c)


def test_score_runs_a_long_shared_prompt_once():
    """`score` at a budget below one whole row per sample still runs the group's prompt once (counted at the
    embedding), with the log-probs of a budget that holds everything."""
    model, tok = tiny_model("llama", seed=0)
    prompt = chat(tok, "a prompt long enough to matter " * 8)
    completions = [[40, 41, 42], [43, 44], [45, 46, 47, 48], [50]]
    embedded = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: embedded.append(i[0].numel()))
    tight = score(model, [prompt] * 4, completions, token_budget=len(prompt) + 4)
    hook.remove()
    assert sum(embedded) == len(prompt) - 1 + 4 * 5  # the prompt but its last token once, then 4 padded rows
    roomy = score(model, [prompt] * 4, completions, token_budget=10**6)
    for a, b in zip(tight, roomy, strict=True):
        assert (a - b).abs().max() < BATCH_TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("frozen", [False, True])
def test_learner_logprobs_in_chunks_are_autograds(temperature, frozen):
    """The learner's log-probs run the LM head in chunks, over more rows than one chunk: the values equal
    autograd's through the whole head and log-softmax bit for bit, and no chunk of logits is kept for the
    backward. A trained head (full fine-tuning) checkpoints each chunk: the gradient to the hidden states bit for
    bit, the weight's the chunks' products summed, a rounding apart (measured 3.6e-7 relative). A frozen head
    (LoRA) takes each position's gradient in the forward: a rounding apart (measured 3.2e-7 relative)."""
    from sparserl.engine.chunked_head import TARGET_CHUNK, head_logprobs

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(24, 500, bias=False)
    torch.nn.init.normal_(head.weight, generator=g)
    head.weight.requires_grad_(not frozen)
    hidden = torch.randn(2, TARGET_CHUNK + 7, 24, generator=g).requires_grad_(True)
    targets = torch.randint(500, hidden.shape[:2], generator=g)
    weights = torch.randn(hidden.shape[:2], generator=g)
    wrt = (hidden,) if frozen else (hidden, head.weight)
    plain = (head(hidden) / temperature).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    want = torch.autograd.grad((plain * weights).sum(), wrt)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked = head_logprobs(head, hidden, targets, temperature)
    got = torch.autograd.grad((chunked * weights).sum(), wrt)
    assert torch.equal(plain, chunked)
    assert saved and max(saved) < TARGET_CHUNK * 500  # no chunk of logits, let alone all of them
    for w, o in zip(want, got, strict=True):
        assert (w - o).abs().max() <= 1e-6 * w.abs().max()
    if not frozen:
        assert torch.equal(want[0], got[0])
    with torch.no_grad():
        assert torch.equal(head_logprobs(head, hidden, targets, temperature), plain)


def test_learner_entropy_in_chunks_is_the_whole_heads():
    """With an entropy term (a frozen head) the head runs in chunks too: log-probs and entropies equal autograd's
    through the whole head bit for bit, the gradient to the hidden states a rounding apart, and no chunk of
    logits is kept."""
    from sparserl.engine.chunked_head import TARGET_CHUNK, head_logprobs

    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(24, 500, bias=False)
    torch.nn.init.normal_(head.weight, generator=g)
    head.weight.requires_grad_(False)  # LoRA: a frozen head
    hidden = torch.randn(2, TARGET_CHUNK + 7, 24, generator=g).requires_grad_(True)
    targets = torch.randint(500, hidden.shape[:2], generator=g)
    w_logp, w_ent = torch.randn(hidden.shape[:2], generator=g), torch.randn(hidden.shape[:2], generator=g)
    logp_all = (head(hidden) / 0.7).log_softmax(-1)
    plain = logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)
    (want,) = torch.autograd.grad((plain[0] * w_logp + plain[1] * w_ent).sum(), hidden)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logp, entropy = head_logprobs(head, hidden, targets, 0.7, with_entropy=True)
    (got,) = torch.autograd.grad((logp * w_logp + entropy * w_ent).sum(), hidden)
    assert torch.equal(logp, plain[0]) and torch.equal(entropy, plain[1])
    assert (want - got).abs().max() <= 1e-6 * want.abs().max()
    assert saved and max(saved) < TARGET_CHUNK * 500
