"""Teacher-forced log-probs under the sampler's sparse attention, with gradients (DistillSparse).

Given prompts and completions, each completion position is recomputed the way the block_topk sampler computed
it: the prompt densely (the sampler's prefill), then every fed completion token's query reading only the pages
its own group-mean query selects (page 0, the current page and the one before, the best-scored full pages up to
the budget the schedule gives at that length), with `kv.dense_layers` dense. The selection is replayed by the
sampler's own code (`PageSparseAttention.select_pages` on one `StepPlan` per row), so it cannot drift from it.

Why SDPA with a boolean mask rather than FlexAttention: the selection depends on the query itself, per position,
layer and KV head, so the mask is data-dependent and rebuilt every call; SDPA takes it as a plain tensor, runs
eagerly on CPU and CUDA with autograd, and needs no `torch.compile` (FlexAttention's block masks pay off only
compiled, on GPU, and its 128-token blocks are coarser than our 16-token pages). The selection itself is discrete
and taken without gradient; gradients flow through the attention over the selected keys, as in the sampler.

Eviction is replayed the same way from what the sampler held (`engine.held`: per sample, the positions each
layer and KV head kept after every cut): each query reads its step's held positions, in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from sparserl.engine.decoder import Decoder
from sparserl.engine.held import HeldRecord, held_mask
from sparserl.engine.kv_config import KVConfig
from sparserl.engine.scoring import at_completions, completion_targets, right_padded
from sparserl.engine.sparse_attention import make_sparse_attention
from sparserl.engine.sparse_attention.base import StepPlan
from sparserl.errors import UserError


class PageReplay:
    """The block_topk sampler's attention, replayed over whole sequences: per sparse layer, the mask of the keys
    each query read (see the module docstring)."""

    def __init__(self, kv: KVConfig, num_layers: int):
        self.reader = make_sparse_attention(kv, num_layers)
        self.schedule = kv.budget_schedule
        self.page_size = kv.page_size

    @torch.no_grad()
    def mask(
        self, layer: int, q: Tensor, k: Tensor, prompt_len: list[int], fed_len: list[int]
    ) -> Tensor | None:
        """Keys each query reads [B, Hkv, N, N] in `layer` given its queries q [B, Hq, N, D] and keys k [B, Hkv,
        N, D]: causal for the prompt (dense prefill), the selected pages for fed completion tokens; None for a
        dense layer."""
        if layer not in self.reader.sparse_layers:
            return None
        b, hkv, n, d = k.shape
        ps = self.page_size
        causal = _causal(n, k.device)
        mask = causal.expand(b, hkv, n, n).clone()
        whole, pages = n // ps, -(-n // ps)
        summaries = self.reader.selector.summarise(k[:, :, : whole * ps].reshape(b, hkv, whole, ps, d))
        # the partial last page is never scored (only full pages are candidates): a zero summary, as in the cache
        summaries = nn.functional.pad(summaries, (0, 0, 0, 0, 0, pages - whole))
        key_page = torch.arange(n, device=k.device) // ps
        for row in range(b):
            first, end = prompt_len[row], fed_len[row]
            if end <= first:
                continue
            positions = torch.arange(first, end, device=k.device)
            tokens = positions + 1  # held once the fed token is written, as at the sampler's step
            plan = StepPlan.make(tokens, self.schedule.budget(tokens), ps)
            if plan.width == 0:  # every step's budget covers its pages: dense
                continue
            t = len(positions)
            picked = self.reader.select_pages(
                summaries[row : row + 1].expand(t, *summaries.shape[1:]),
                q[row, :, first:end].transpose(0, 1)[:, :, None],
                plan,
            )  # [t, Hkv, width], -1 pads
            read = torch.zeros(t, hkv, pages + 1, dtype=torch.bool, device=k.device)  # + 1: where -1 pads go
            read.scatter_(2, torch.where(picked >= 0, picked, pages), True)
            mask[row, :, first:end] = read[..., key_page].transpose(0, 1) & causal[first:end]
        return mask


class HeldReplay:
    """An evicting sampler's attention, replayed from what each sample held (`engine.held`): every layer reads,
    per query, the positions its KV heads held at that step."""

    def __init__(self, records: Sequence[HeldRecord]):
        self.records = list(records)

    @torch.no_grad()
    def mask(self, layer: int, q: Tensor, k: Tensor, prompt_len: list[int], fed_len: list[int]) -> Tensor:
        """Keys each query reads [B, Hkv, N, N] in `layer`: causal for the prompt, the held positions for fed
        completion tokens (`q` is unused: what was held does not depend on the replay's queries)."""
        b, hkv, n, _ = k.shape
        causal = _causal(n, k.device)
        mask = causal.expand(b, hkv, n, n).clone()
        for row, record in enumerate(self.records):
            first, end = prompt_len[row], fed_len[row]
            if end > first:
                mask[row, :, first:end] = (
                    held_mask(record, layer, first, end, n).to(k.device) & causal[first:end]
                )
        return mask


def make_replay(kv: KVConfig, num_layers: int, held: Sequence[HeldRecord] | None) -> PageReplay | HeldReplay:
    """The replay of `kv`'s sampler: block-sparse pages from the queries themselves, eviction from `held`."""
    if kv.sparse_attention:
        return PageReplay(kv, num_layers)
    if not kv.evicting:
        raise UserError(f"a sparse teacher-forced forward needs a sparse kv.method, not {kv.method!r}")
    if held is None:
        raise UserError(
            f"replaying kv.method={kv.method!r} needs what the sampler held: sample with an "
            "`engine.held.HeldRecorder` as an engine step hook and pass its records (one per completion)"
        )
    return HeldReplay(held)


def _causal(n: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def sparse_completion_logits(
    model: nn.Module,
    kv: KVConfig,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    held: Sequence[HeldRecord] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Logits [B, T, V] predicting each completion token under the sampler's sparse attention (block-sparse,
    or eviction replayed from `held`, one record per completion), the targets [B, T] and the mask [B, T] (T:
    the longest completion; rows right-padded). Differentiable."""
    dec = Decoder(model)  # the model's own modules: its active adapters, autocast, autograd
    if held is not None and len(held) != len(prompt_ids):
        raise ValueError(f"held: {len(held)} records for {len(prompt_ids)} completions (one each)")
    replay = make_replay(kv, dec.num_layers, held)
    device = dec.device
    # what the sampler fed: the prompt (prefilled), then every completion token but the last
    ids, _ = right_padded(
        [list(p) + list(c)[:-1] for p, c in zip(prompt_ids, completion_ids, strict=True)], device
    )
    prompt_len = [len(p) for p in prompt_ids]
    fed_len = [len(p) + len(c) - 1 for p, c in zip(prompt_ids, completion_ids, strict=True)]
    b, n = ids.shape
    hidden = dec.embed(ids)
    rope = dec.rope(hidden, torch.arange(n, device=device)[None].expand(b, n))
    group = dec.num_heads // dec.num_kv_heads
    for layer in range(dec.num_layers):
        qkv = dec.qkv(layer, hidden, rope)
        keys = replay.mask(layer, qkv.q.detach(), qkv.k.detach(), prompt_len, fed_len)
        if keys is not None:  # per KV head -> per query head
            keys = keys[:, :, None].expand(b, dec.num_kv_heads, group, n, n).reshape(b, dec.num_heads, n, n)
        out = nn.functional.scaled_dot_product_attention(
            qkv.q, qkv.k, qkv.v, attn_mask=keys, is_causal=keys is None, enable_gqa=True
        )
        hidden = dec.finish_layer(layer, hidden, out)
    targets, mask = completion_targets(completion_ids)
    picked = at_completions(hidden, prompt_ids, completion_ids, targets.shape[1])
    return dec.logits(picked), targets.to(device), mask.to(device)


def sparse_completion_logprobs(
    model: nn.Module,
    kv: KVConfig,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
    held: Sequence[HeldRecord] | None = None,
) -> tuple[Tensor, Tensor]:
    """Differentiable per-token log-probs [B, T] of each completion under the sampler's sparse attention, and
    the mask [B, T]; the sparse counterpart of `scoring.completion_logprobs`."""
    logits, targets, mask = sparse_completion_logits(model, kv, prompt_ids, completion_ids, held)
    logp = (logits / temperature).log_softmax(dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return logp * mask, mask
