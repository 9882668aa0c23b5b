"""SPEC-RL's coupled verification on the rollout engine itself, keeping each draft's state where it is cut.

A group's drafts are teacher-forced after their prompt, prefilled once (the sampler's own dense prefill,
`RolloutEngine.prefilled`), CHUNK draft tokens at a time: each chunk attends to the prompt's keys and the draft's before it
(the rows' cache), and only the drafts kept whole so far go on to the next one. A draft is cut at the first
position where the engine draws another token than the draft's at the draft stream's uniform number
(`scoring.coupled_cut`), and its state there is kept as a fork state (engine/forks.py `Snapshot`: the cache row of
prompt + kept prefix, and the logits the next token is drawn from). The continuation starts from it: no second
prefill of prompt and prefix. Causal attention makes a row cut at the kept prefix what a prefill of prompt +
prefix writes. Not for evicting engines: a prompt cut to its budget depends on the queries at its end, which the
draft's pass does not end with (they keep the scoring path, `scoring.redraw`, and prefill again).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sparserl.engine.cache import KVCache
from sparserl.engine.forks import Snapshot
from sparserl.engine.padding import right_pad
from sparserl.engine.scoring import coupled_cut

if TYPE_CHECKING:
    from sparserl.engine.rollout import RolloutEngine

CHUNK = 16  # draft tokens teacher-forced at a time: past a draft's cut none are needed


def _prompts(engine: RolloutEngine, prompts: Sequence[Sequence[int]]) -> tuple[KVCache, Tensor]:
    """The prompts prefilled together (`RolloutEngine.prefilled`: a cache row each) and the logits [P, V] of the
    token after each."""
    lengths = torch.tensor([len(p) for p in prompts], device=engine.decoder.device)
    return engine.prefilled([list(p) for p in prompts], lengths, ())


def _prompt_rows(engine: RolloutEngine, head: KVCache, row: int, rows: int, width: int) -> KVCache:
    """A cache of `rows` rows of `width` slots, each a copy of row `row` of the prefilled prompts `head`."""
    dec = engine.decoder
    cache = KVCache(dec.num_layers, 0, dec.num_kv_heads, dec.num_heads, dec.head_dim, width, engine.kv.window,
                    dec.dtype, dec.device)  # fmt: skip
    cache.append(head, torch.full((rows,), row, dtype=torch.long, device=dec.device))
    return cache


def _chunk_hidden(engine: RolloutEngine, cache: KVCache, rows: Tensor, tokens: list[list[int]]) -> Tensor:
    """Feed `tokens` (up to CHUNK a row, after the `rows`' cached positions, all as long) through the model,
    writing their keys and values into the rows; the last hidden states [r, S, H]."""
    dec, dev = engine.decoder, engine.decoder.device
    held, s, r = int(cache.length[rows[0]]), max(map(len, tokens)), rows.numel()
    ids = right_pad(tokens, value=engine.tokenizer.pad_token_id or 0, width=s)[0].to(dev)
    hidden = dec.embed(ids)
    positions = (held + torch.arange(s, device=dev))[None, :].expand(r, s)
    rope = dec.rope(hidden, positions)
    see = torch.ones(s, held + s, dtype=torch.bool, device=dev).tril(diagonal=held)  # padding follows: unseen
    for layer in range(dec.num_layers):
        qkv = dec.qkv(layer, hidden, rope)
        k = torch.cat([cache.k[layer][rows, :, :held], qkv.k], dim=2)
        v = torch.cat([cache.v[layer][rows, :, :held], qkv.v], dim=2)
        out = nn.functional.scaled_dot_product_attention(qkv.q, k, v, attn_mask=see, enable_gqa=True)
        cache.k[layer][rows, :, held : held + s] = qkv.k
        cache.v[layer][rows, :, held : held + s] = qkv.v
        cache.pos[layer][rows, :, held : held + s] = positions[:, None, :].to(torch.int32)
        hidden = dec.finish_layer(layer, hidden, out)
    return hidden


def verify_group(
    engine: RolloutEngine,
    prompt: tuple[KVCache, int, Tensor],
    drafts: Sequence[Sequence[int]],
    uniforms: Sequence[Tensor],
    temperature: float,
) -> tuple[KVCache, list[tuple[int, Tensor, Tensor]]]:
    """One prompt's drafts (`prompt`: the prefilled prompts, its row there and the logits after it) verified CHUNK
    tokens at a time: a cache whose rows hold prompt + kept prefix, and per draft its cut, its tokens' log-probs
    up to the cut at least, and the logits [V] at the cut."""
    dec, (head, row, first) = engine.decoder, prompt
    p = int(head.length[row])
    cache = _prompt_rows(engine, head, row, len(drafts), p + max(map(len, drafts)))
    carry = {r: first for r in range(len(drafts))}  # the logits of each draft's next token, while it is kept
    logps: dict[int, list[Tensor]] = {r: [] for r in carry}
    out: list[tuple[int, Tensor, Tensor] | None] = [None] * len(drafts)
    for r in [r for r in carry if not drafts[r]]:  # nothing to verify: the prompt's logits
        out[r] = (0, first.new_zeros(0).cpu(), carry.pop(r))
    for start in range(0, max(map(len, drafts)), CHUNK):
        live = list(carry)  # kept whole so far: each holds prompt + start positions
        if not live:
            break
        rows = torch.tensor(live, device=cache.length.device)
        hidden = _chunk_hidden(engine, cache, rows, [list(drafts[r][start : start + CHUNK]) for r in live])
        for j, r in enumerate(live):
            m = min(CHUNK, len(drafts[r]) - start)
            # the distributions of tokens start..start+m-1, then of the one after them
            logits = torch.cat([carry[r][None], dec.logits(hidden[j, :m])])
            cut, logp = coupled_cut(
                logits[:m], drafts[r][start : start + m], uniforms[r][start:], temperature
            )
            logps[r].append(logp)
            if cut < m or start + m == len(drafts[r]):  # cut, or kept whole (then the logits after it)
                out[r] = (start + cut, torch.cat(logps[r]), logits[cut].clone())
                del carry[r]
            else:
                carry[r] = logits[m].clone()
            cache.length[r] = p + start + cut
    return cache, out  # type: ignore[return-value]


def _passes(
    engine: RolloutEngine, prompts: Sequence[Sequence[int]], batched: bool
) -> Iterator[tuple[list[int], tuple[KVCache, int, Tensor]]]:
    """The drafts verified together and their prompt's prefill (cache, row, logits after it): batched, a prompt's
    drafts, every prompt prefilled at once; else one draft at a time, its prompt prefilled alone."""
    if not batched:
        for i, prompt in enumerate(prompts):
            head, first = _prompts(engine, [prompt])
            yield [i], (head, 0, first[0])
        return
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    head, first = _prompts(engine, list(groups))
    for g, rows in enumerate(groups.values()):
        yield rows, (head, g, first[g])


def redraw_states(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]],
    uniforms: Sequence[Tensor],
    temperature: float,
    batched: bool = True,
) -> list[tuple[int, Tensor, Snapshot]]:
    """Per draft: how many of its leading tokens the engine draws at its uniforms, their log-probs (up to that
    cut at least) and the state before the first token it draws itself. `batched`: a prompt's drafts together
    (else one at a time, so that a draft's numbers do not depend on its batch mates). Call inside
    `engine.decoding()`."""
    if engine.evictor is not None:
        raise ValueError(
            "an evicting engine cuts prompts by their last queries: verify drafts with scoring.redraw"
        )
    out: list[tuple[int, Tensor, Snapshot] | None] = [None] * len(prompts)
    for rows, at in _passes(engine, prompts, batched):
        cache, kept = verify_group(
            engine, at, [drafts[i] for i in rows], [uniforms[i] for i in rows], temperature
        )
        if engine.sparse is not None:  # page summaries of the rows as cut
            engine.sparse.start(cache)
        for row, (i, (cut, logp, logits)) in enumerate(zip(rows, kept, strict=True)):
            held = cache.row_snapshot(row)  # the dense engine's state holds as many positions
            out[i] = (cut, logp, Snapshot(cut, 0.0, held, logits, dense_positions=int(held.length[0])))
    return out  # type: ignore[return-value]
