"""SPEC-RL's coupled verification on the rollout engine itself, keeping each draft's state where it is cut.

A group's drafts are teacher-forced in one pass after their prompt, prefilled once (the sampler's own dense
prefill, `prefill_hidden`; each draft token attends to the prompt's keys and to the draft's before it), cut at the
first position where the engine draws another token than the draft's at the draft stream's uniform number
(`scoring.coupled_cut`), and each draft's state there is kept as a fork state (engine/forks.py `Snapshot`: the
cache row of prompt + kept prefix, and the logits the next token is drawn from). The continuation starts from it:
no second prefill of prompt and prefix. Causal attention makes a row cut at the kept prefix what a prefill of
prompt + prefix writes. Not for evicting engines: a prompt cut to its budget depends on the queries at its end,
which the draft's pass does not end with (they keep the scoring path, `scoring.redraw`, and prefill again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sparserl.engine.cache import KVCache
from sparserl.engine.forks import Snapshot
from sparserl.engine.padding import right_pad
from sparserl.engine.scoring import coupled_cut

if TYPE_CHECKING:
    from sparserl.engine.rollout import RolloutEngine


LOGIT_CHUNK = 16  # draft positions whose logits are computed at a time: past the cut none are needed


def teacher_forced_pass(
    engine: RolloutEngine, prompt: Sequence[int], drafts: Sequence[Sequence[int]]
) -> tuple[KVCache, Tensor, Tensor]:
    """The drafts of one prompt teacher-forced after it: a cache whose rows hold prompt + draft, the first draft
    token's logits [V] and the last hidden states [rows, S, H] (`decoder.logits` at position t: the draft's token
    t + 1's logits)."""
    dec, dev = engine.decoder, engine.decoder.device
    p, rows = len(prompt), len(drafts)
    head, prompt_hidden = engine.prefill_hidden([list(prompt)], torch.tensor([p], device=dev))
    lengths = torch.tensor([len(d) for d in drafts], device=dev)
    s = int(lengths.max())
    ids = right_pad(drafts, value=engine.tokenizer.pad_token_id or 0, width=s)[0].to(dev)
    cache = KVCache(dec.num_layers, rows, dec.num_kv_heads, dec.num_heads, dec.head_dim, p + s, engine.kv.window,
                    dec.dtype, dev)  # fmt: skip
    hidden = dec.embed(ids)
    rope = dec.rope(hidden, (p + torch.arange(s, device=dev))[None, :].expand(rows, s))
    # every draft token sees the whole prompt and the draft's tokens up to itself (padding follows: unseen)
    see = torch.ones(s, p + s, dtype=torch.bool, device=dev).tril(diagonal=p)
    for layer in range(dec.num_layers):
        qkv = dec.qkv(layer, hidden, rope)
        k = torch.cat([head.k[layer].expand(rows, -1, -1, -1), qkv.k], dim=2)
        v = torch.cat([head.v[layer].expand(rows, -1, -1, -1), qkv.v], dim=2)
        out = nn.functional.scaled_dot_product_attention(qkv.q, k, v, attn_mask=see, enable_gqa=True)
        cache.k[layer].copy_(k)
        cache.v[layer].copy_(v)
        cache.pos[layer].copy_(torch.arange(p + s, dtype=torch.int32, device=dev).expand_as(cache.pos[layer]))
        hidden = dec.finish_layer(layer, hidden, out)
    cache.length.copy_(p + lengths)
    cache.query_count.copy_(p + lengths)
    return cache, dec.logits(prompt_hidden[0, p - 1]), hidden


def _cut(
    engine: RolloutEngine,
    first: Tensor,
    hidden: Tensor,
    draft: Sequence[int],
    uniforms: Tensor,
    temperature: float,
) -> tuple[int, Tensor, Tensor]:
    """One draft's cut (`scoring.coupled_cut`), its tokens' log-probs up to the cut at least, and the logits
    [V] at the cut, the draft's positions taken LOGIT_CHUNK at a time until the cut."""
    n, logps = len(draft), []
    for start in range(0, n + 1, LOGIT_CHUNK):
        end = min(start + LOGIT_CHUNK, n + 1)  # positions start..end - 1; position t predicts token t
        at = hidden[max(start - 1, 0) : end - 1]
        logits = engine.decoder.logits(at) if start else torch.cat([first[None], engine.decoder.logits(at)])
        m = min(end, n) - start  # draft tokens among them (none: only the position after the draft)
        cut, logp = (
            coupled_cut(logits[:m], draft[start:end], uniforms[start:], temperature) if m else (0, None)
        )
        logps += [logp] if m else []
        if cut < m or end == n + 1:
            return start + cut, torch.cat(logps) if logps else first.new_zeros(0).cpu(), logits[cut].clone()
    raise AssertionError("unreachable: the last chunk holds position n")


def redraw_states(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]],
    uniforms: Sequence[Tensor],
    temperature: float,
    batched: bool = True,
) -> list[tuple[int, Tensor, Snapshot]]:
    """Per draft: how many of its leading tokens the engine draws at its uniforms, their log-probs (up to that
    cut at least) and the state before the first token it draws itself. `batched`: a prompt's drafts in one pass
    (else one at a time, so that a draft's numbers do not depend on its batch mates). Call inside
    `engine.decoding()`."""
    if engine.evictor is not None:
        raise ValueError(
            "an evicting engine cuts prompts by their last queries: verify drafts with scoring.redraw"
        )
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    passes = [rows[j : j + 1] for rows in groups.values() for j in range(len(rows))]
    out: list[tuple[int, Tensor, Snapshot] | None] = [None] * len(prompts)
    for rows in list(groups.values()) if batched else passes:
        cache, first, hidden = teacher_forced_pass(engine, prompts[rows[0]], [drafts[i] for i in rows])
        kept = [
            _cut(engine, first, hidden[row], drafts[i], uniforms[i], temperature)
            for row, i in enumerate(rows)
        ]
        for row, (i, (cut, _, _)) in enumerate(zip(rows, kept, strict=True)):
            cache.length[row] = len(prompts[i]) + cut
        if engine.sparse is not None:  # page summaries of the rows as cut
            engine.sparse.start(cache)
        for row, (i, (cut, logp, logits)) in enumerate(zip(rows, kept, strict=True)):
            out[i] = (cut, logp, Snapshot(cut, 0.0, cache.row_snapshot(row), logits))
    return out  # type: ignore[return-value]
