"""SPEC-RL's coupled verification on the rollout engine itself, keeping each draft's state where it is cut.

Each draft is prefilled teacher-forced after its prompt (the sampler's own dense prefill, `prefill_hidden`), cut
at the first position where the engine draws another token than the draft's at the draft stream's uniform number
(`scoring.coupled_cut`), and its state there is kept as a fork state (engine/forks.py `Snapshot`: the cache row
of prompt + kept prefix, and the logits the next token is drawn from). The continuation starts from it: no second
prefill of prompt and prefix. Causal attention makes a row cut at the kept prefix what a prefill of prompt +
prefix writes. Not for evicting engines: a prompt cut to its budget depends on the queries at its end, which the
draft's prefill does not end with (they keep the scoring path, `scoring.redraw`, and prefill again).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparserl.engine.forks import Snapshot
from sparserl.engine.scoring import coupled_cut

if TYPE_CHECKING:
    from sparserl.engine.rollout import RolloutEngine

LOGIT_POSITIONS = (
    2048  # logits [positions, V] of one chunk of drafts: 400 MB at SmolLM2's 49,152-token vocabulary
)


def _chunks(sizes: Sequence[int], budget: int) -> Iterator[list[int]]:
    """Consecutive indices whose sizes sum to at most `budget` (one at least; `budget` 0: one at a time)."""
    chunk: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if chunk and (not budget or total + size > budget):
            yield chunk
            chunk, total = [], 0
        chunk.append(i)
        total += size
    if chunk:
        yield chunk


def redraw_states(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]],
    uniforms: Sequence[Tensor],
    temperature: float,
    batched: bool = True,
) -> list[tuple[int, Tensor, Snapshot]]:
    """Per draft: how many of its leading tokens the engine draws at its uniforms, their log-probs [n] and the
    state before the first token it draws itself (`batched` False: one draft at a time, so a draft's numbers do
    not depend on its batch mates). Call inside `engine.decoding()`."""
    if engine.evictor is not None:
        raise ValueError(
            "an evicting engine cuts prompts by their last queries: verify drafts with scoring.redraw"
        )
    out: list[tuple[int, Tensor, Snapshot] | None] = [None] * len(prompts)
    sizes = [len(d) + 1 for d in drafts]
    dev = engine.decoder.device
    for chunk in _chunks(sizes, LOGIT_POSITIONS if batched else 0):
        inputs = [[*prompts[i], *drafts[i]] for i in chunk]
        cache, hidden = engine.prefill_hidden(inputs, torch.tensor([len(x) for x in inputs], device=dev))
        kept = []
        for row, i in enumerate(chunk):
            p, n = len(prompts[i]), len(drafts[i])
            logits = engine.decoder.logits(
                hidden[row, p - 1 : p + n]
            )  # [n + 1, V]: each draft token's, and after
            cut, logp = coupled_cut(logits[:n], drafts[i], uniforms[i], temperature)
            cache.length[row] = p + cut
            kept.append((i, cut, logp, logits[cut].clone()))
        if engine.sparse is not None:  # page summaries of the rows as cut
            engine.sparse.start(cache)
        for row, (i, cut, logp, next_logits) in enumerate(kept):
            out[i] = (cut, logp, Snapshot(cut, 0.0, cache.row_snapshot(row), next_logits))
    return out  # type: ignore[return-value]
