"""Teacher-forced log-probs of completions under a model with dense attention (old, reference and learner), and,
on request, the dense next-token distributions at every completion position (the acceptance rate's dense side),
and where a draft's tokens stop being what the model would draw now (`redraw`, SPEC-RL's coupled verification)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from copy import deepcopy

import torch
from torch import Tensor, nn

from sparserl.engine.chunked_head import head_logprobs, target_logprobs
from sparserl.engine.decoder import causal_lm
from sparserl.engine.module_mode import module_mode
from sparserl.engine.padding import right_pad
from sparserl.engine.prefill_reuse import reused
from sparserl.engine.sampling import (
    TokenDistributions,
    check_distribution_request,
    distributions_of,
    processed_logprobs,
    sample_next,
)
from sparserl.engine.weights import head_logits


def _completion_logits(
    model: nn.Module, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> tuple[Tensor, Tensor, Tensor]:
    """Logits [B, T, V] predicting each completion token from its prompt and the tokens before it, the targets
    [B, T] and the mask [B, T] (`_completion_hidden` through the LM head)."""
    hidden, targets, mask = _completion_hidden(model, prompt_ids, completion_ids)
    return head_logits(causal_lm(model).lm_head, hidden).float(), targets, mask


def _completion_hidden(
    model: nn.Module, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> tuple[Tensor, Tensor, Tensor]:
    """Final hidden states [B, T, H] at the positions that predict each completion token from its prompt and the
    tokens before it, the targets [B, T] and the mask [B, T]. T is the longest completion; rows are right-padded
    (mask 0).

    Rows that share their prompt (a GRPO group) share its forward pass: the prompt (but its last token) runs once,
    its KV is repeated to the group's rows, and only the last prompt token and the completions run per row. The
    gradient flows back through the shared pass (repeating is differentiable), so the result is the per-row
    forward's up to rounding, for a fraction of its work: with 1 prompt x 8 samples of 76 + ~48 tokens, ~460
    tokens instead of ~990."""
    lm = causal_lm(model)
    device = lm.lm_head.weight.device
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompt_ids):
        groups.setdefault(tuple(p), []).append(i)
    targets, mask = completion_targets(completion_ids)
    t_c = targets.shape[1]
    if not shares_prompts(lm) or all(len(rows) == 1 or len(prompt) < 2 for prompt, rows in groups.items()):
        hidden = _hidden_at_completions(lm, list(prompt_ids), list(completion_ids), t_c, device)
    else:
        parts = [
            (rows, _shared_prompt_hidden(lm, list(prompt), [completion_ids[i] for i in rows], t_c, device))
            for prompt, rows in groups.items()
        ]
        order = torch.tensor([i for rows, _ in parts for i in rows], device=device)
        hidden = torch.cat([h for _, h in parts])[order.argsort()]  # back to the callers' row order
    return hidden, targets.to(device), mask.to(device)


def shares_prompts(model: nn.Module) -> bool:
    """Whether `_completion_logits` runs a prompt that several rows share once (see `micro_batches`)."""
    lm = causal_lm(model)
    return not (recomputes_activations(lm) or layers_sharded(lm))


def layers_sharded(lm: nn.Module) -> bool:
    """True when the decoder layers are FSDP-sharded (trainer/sharding.py): FSDP gathers a layer's weights for
    its backward from hooks on the layer's outputs, which a group's prompt KV, reused by later passes, bypasses;
    each row then runs its whole sequence."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    first = next(iter(lm.model.layers[0].parameters()), None)
    return isinstance(first, DTensor)


def recomputes_activations(lm: nn.Module) -> bool:
    """True while the decoder recomputes its activations in the backward (gradient checkpointing, training
    with grad): transformers then runs it without a KV cache, so a group's prompt cannot be shared through one."""
    return (
        bool(getattr(lm.model, "gradient_checkpointing", False)) and lm.training and torch.is_grad_enabled()
    )


def completion_targets(completion_ids: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """Token ids [B, T] and mask [B, T] of right-padded completions (T: the longest, at least 1)."""
    return right_pad(completion_ids, width=max(max(len(c) for c in completion_ids), 1))


def at_completions(hidden: Tensor, prompt_ids, completion_ids, t_c: int) -> Tensor:
    """Hidden states [B, W, H] of rows that start with their prompt -> [B, t_c, H] at the positions that predict
    each completion token (the prompt's last, then every completion token but the last)."""
    gather = torch.zeros(len(prompt_ids), t_c, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        gather[i, : len(c)] = torch.arange(len(p) - 1, len(p) + len(c) - 1)
    return hidden.gather(1, gather.to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1]))


def right_padded(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Token ids and attention mask [B, W] of right-padded rows."""
    ids, mask = right_pad(rows)
    return ids.to(device), mask.long().to(device)


def _hidden_at_completions(lm, prompt_ids, completion_ids, t_c: int, device) -> Tensor:
    """Final hidden states [B, t_c, H] at the positions that predict each completion token, one forward per row."""
    ids, attn = right_padded(
        [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)], device
    )
    hidden = lm.model(input_ids=ids, attention_mask=attn).last_hidden_state
    return at_completions(hidden, prompt_ids, completion_ids, t_c)


def _cache_name(decoder: nn.Module) -> str:
    """The decoder's name for its KV cache, argument and output: transformers 5.24 renamed `past_key_values` to
    `cache` (the old name warns on every call and goes in 5.40); the versions pyproject allows have either."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _shared_prompt_hidden(lm, prompt: list[int], completions, t_c: int, device) -> Tensor:
    """`_hidden_at_completions` for rows of one prompt: the prompt but its last token runs once (a single row,
    or a one-token prompt, has nothing to share and runs as one)."""
    if len(prompt) < 2 or len(completions) == 1:
        return _hidden_at_completions(lm, [prompt] * len(completions), completions, t_c, device)
    head = torch.tensor([prompt[:-1]], dtype=torch.long, device=device)
    name = _cache_name(lm.model)
    past = reused(  # without grad, the same for every call on this prompt: a calibration's budgets reuse it
        ("score", id(lm), tuple(prompt)),
        lambda: getattr(lm.model(input_ids=head, use_cache=True), name),
        deepcopy,
    )
    past.batch_repeat_interleave(len(completions))
    ids, attn = right_padded([[prompt[-1], *c] for c in completions], device)
    attn = torch.cat([attn.new_ones(len(completions), head.shape[1]), attn], dim=1)
    hidden = lm.model(input_ids=ids, attention_mask=attn, **{name: past}).last_hidden_state
    hidden = hidden[:, :t_c]
    return torch.nn.functional.pad(hidden, (0, 0, 0, t_c - hidden.shape[1]))


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    with_entropy: bool = False,
    kept: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Differentiable per-token log-probs `logp` [B, T] of each completion given its prompt, and `mask` [B, T].

    T is the longest completion; rows are right-padded (mask 0). With `with_entropy`, also the entropy [B, T] of
    each position's distribution (after temperature). `kept` (uint8 [B, >= T, V / 8], the sampler's kept sets
    as bits, algo/keep_sampling.py) renormalises every distribution over its position's kept ids.

    The [B, T, V] logits never exist whole, with or without grad (`head_logprobs`).
    """
    hidden, targets, mask = _completion_hidden(model, prompt_ids, completion_ids)
    kept = kept[:, : targets.shape[1]] if kept is not None else None
    out = head_logprobs(causal_lm(model).lm_head, hidden, targets, temperature, kept, with_entropy)
    if not with_entropy:
        return out * mask, mask
    return out[0] * mask, mask, out[1] * mask


def micro_batches(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    token_budget: int,
    shared_prompts: bool = True,
) -> Iterator[list[int]]:
    """Indices of the completions, shortest first, in chunks of at most `token_budget` tokens (at least one
    completion per chunk), counted as `_completion_logits` runs them. Per row (no `shared_prompts`, or no prompt
    shared in the chunk): one forward of every row padded to the chunk's longest. Shared: the largest of the
    passes it runs (each group's prompt alone, then its rows' completions, whose hidden states and logits stay
    for the chunk), and the prompt KV it repeats to the rows over `SHARED_KV_PER_TOKEN`. Counting a shared prompt
    once is what lets a group of long prompts share its pass at all (4 samples of a 6k-token prompt came one a
    chunk at the default budget, each re-running the prompt)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    width = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    order = sorted(range(len(width)), key=width.__getitem__)
    start = 0
    while start < len(order):
        cost, end = _ChunkCost(shared_prompts), start
        while end < len(order) and cost.admits(
            prompt_ids[order[end]], completion_ids[order[end]], token_budget
        ):
            end += 1
        yield order[start:end]
        start = end


SHARED_KV_PER_TOKEN = 4
"""A shared pass repeats its prompt's KV to every row (transformers' cache copies it): a chunk may hold 4 prompt
positions of KV per token of its budget (8192: 32,768 positions, 1.4 GiB for SmolLM2 in float32), enough for 4
samples of an 8k prompt to share one pass; a per-row chunk holds one per token (its own cache)."""


class _ChunkCost:
    """The tokens a chunk of rows runs in `_completion_logits`, kept as rows are added (see `micro_batches`)."""

    def __init__(self, shared_prompts: bool) -> None:
        self.shared_prompts = shared_prompts
        self.groups: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt -> (rows, longest completion)
        self.rows, self.widest = 0, 0

    def admits(self, prompt: Sequence[int], completion: Sequence[int], budget: int) -> bool:
        """Add the row if the chunk's tokens stay within `budget` with it (a chunk's first row always)."""
        n, longest = self.groups.get(tuple(prompt), (0, 0))
        groups = {**self.groups, tuple(prompt): (n + 1, max(longest, len(completion)))}
        rows, widest = self.rows + 1, max(self.widest, len(prompt) + len(completion))
        if self.rows and self._tokens(groups, rows, widest) > budget:
            return False
        self.groups, self.rows, self.widest = groups, rows, widest
        return True

    def _tokens(self, groups: dict[tuple[int, ...], tuple[int, int]], rows: int, widest: int) -> int:
        if not self.shared_prompts or all(n == 1 or len(p) < 2 for p, (n, _) in groups.items()):
            return rows * widest  # whole rows, padded
        prompt_pass = max(len(p) - 1 for p in groups)  # each group's prompt runs alone, one after another
        completions = rows * (1 + max(longest for _, longest in groups.values()))  # all padded alike: logits
        copies = sum(n * len(p) for p, (n, _) in groups.items())  # the prompt KV repeated (held to the end)
        return max(prompt_pass, completions, copies // SHARED_KV_PER_TOKEN)


@torch.no_grad()
def score(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    token_budget: int = 8192,
    kept: Tensor | None = None,
) -> list[Tensor]:
    """Per-token log-probs (float32, CPU) of each completion, micro-batched to `token_budget` tokens
    (`micro_batches`); over the sampler's kept sets (`kept`, bits [B, T, V / 8]) when given."""
    out: list[Tensor | None] = [None] * len(prompt_ids)
    with module_mode(model, training=False):  # dropout off while scoring
        for chunk in micro_batches(prompt_ids, completion_ids, token_budget, shares_prompts(model)):
            logp, _ = completion_logprobs(
                model,
                [prompt_ids[i] for i in chunk],
                [completion_ids[i] for i in chunk],
                temperature,
                kept=kept[chunk] if kept is not None else None,
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
    (4 bytes x V per token). Micro-batched to `token_budget` tokens (`micro_batches`)."""
    check_distribution_request(top_logprobs, causal_lm(model).lm_head.out_features, "score_distributions")
    out: list[TokenDistributions | None] = [None] * len(prompt_ids)
    with module_mode(model, training=False):  # dropout off while scoring
        for chunk in micro_batches(prompt_ids, completion_ids, token_budget, shares_prompts(model)):
            logits, _, _ = _completion_logits(
                model, [prompt_ids[i] for i in chunk], [completion_ids[i] for i in chunk]
            )
            for row, i in enumerate(chunk):
                logp = processed_logprobs(logits[row, : len(completion_ids[i])], temperature, top_p, top_k)
                out[i] = distributions_of(logp, top_logprobs, full_logprobs)
    return out  # type: ignore[return-value]


@torch.no_grad()
def redraw(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    uniforms: Sequence[Tensor],
    temperature: float = 1.0,
    token_budget: int = 8192,
) -> list[tuple[int, Tensor]]:
    """For each completion (a draft) and the uniform numbers it was drawn at [>= its length]: the first position
    at which the model, teacher-forced on the draft's prefix, draws another token at the same uniform
    (`sampling.sample_next`: the sampler's inverse-CDF draw; the draft's length when none), and the draft
    tokens' log-probs [T] under the model at `temperature`. The draft's tokens up to that position are the very
    tokens the model would draw now on that stream. `token_budget` 0: one completion at a time (a sequence's
    numbers then do not depend on its batch mates)."""
    out: list[tuple[int, Tensor] | None] = [None] * len(prompt_ids)
    chunks = (
        micro_batches(prompt_ids, completion_ids, token_budget, shares_prompts(model))
        if token_budget
        else ([i] for i in range(len(prompt_ids)))
    )
    with module_mode(model, training=False):
        for chunk in chunks:
            logits, _, _ = _completion_logits(
                model, [prompt_ids[i] for i in chunk], [completion_ids[i] for i in chunk]
            )
            for row, i in enumerate(chunk):
                n = len(completion_ids[i])
                out[i] = coupled_cut(logits[row, :n], completion_ids[i], uniforms[i], temperature)
    return out  # type: ignore[return-value]


def coupled_cut(
    logits: Tensor, draft: Sequence[int], uniforms: Tensor, temperature: float
) -> tuple[int, Tensor]:
    """The first position at which `logits` [n, V], teacher-forced on the n-token `draft`, draw another token
    than the draft's at its uniforms (`sampling.sample_next`; n when none), and the draft tokens' log-probs [n]
    (float32, CPU)."""
    n = len(draft)
    target = torch.tensor(draft, device=logits.device)
    drawn, _, _ = sample_next(logits, uniforms[:n].to(logits.device), temperature)
    differ = (drawn != target).nonzero()
    logp = target_logprobs(logits[None], target[None], temperature)[0]
    return (int(differ[0]) if differ.numel() else n), logp.float().cpu()
