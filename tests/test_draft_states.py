"""SPEC-RL's coupled verification on the engine (engine/draft_states.py): the cut is the one the scoring path
finds (a prompt's drafts verified in one pass after it), and a continuation started from the kept state draws
what a continuation that prefills its prompt and kept prefix again draws, for the dense cache, block_topk and an
int8 cache; evicting engines are refused."""

from __future__ import annotations

import pytest
import torch
from test_eviction import engine, random_prompts
from test_forks import KVS, LOGP_TOL, decode

from sparserl.engine import KVConfig
from sparserl.engine.decoding import Request
from sparserl.engine.draft_states import redraw_states
from sparserl.engine.sampling import sample_uniforms
from sparserl.engine.scoring import redraw

ENGINES = {"dense": KVConfig(), "block_topk": KVS["block_topk"], "int8": KVConfig(quant="int8")}


def drafts_and_states(e, batched: bool = True, temperature: float = 1.01, length: int = 16):
    """Drafts drawn on their streams at temperature 1, verified on them at `temperature`: cut where the two draw
    otherwise (at 1, kept whole). Two drafts a prompt (verified together after it), of different lengths."""
    prompts = random_prompts([13, 22, 9], 6) * 2
    drawn = decode(e, [Request(p, key=j, seed=3, max_new_tokens=length) for j, p in enumerate(prompts)])
    drafts = [drawn.completion(j)[0][: length - 3 * j] for j in range(len(prompts))]
    uniforms = [sample_uniforms(3, [j], len(d))[0] for j, d in enumerate(drafts)]
    with e.decoding():
        got = redraw_states(e, prompts, drafts, uniforms, temperature, batched)
    return prompts, drafts, uniforms, got


@pytest.mark.parametrize(("temperature", "length"), [(1.01, 16), (1.0, 40)])
@pytest.mark.parametrize("name", sorted(ENGINES))
def test_a_continuation_from_the_drafts_state_draws_what_a_re_prefilled_one_draws(name, temperature, length):
    """Cut within the first chunk (1.01), or kept whole over several chunks and continued after the draft (1)."""
    e = engine(ENGINES[name])
    prompts, drafts, _, got = drafts_and_states(e, temperature=temperature, length=length)
    assert any(0 < cut < length for cut, _, _ in got)
    for j, (cut, _, state) in enumerate(got):
        if cut == length:  # nothing left to draw (the rollout layer delivers it)
            continue
        prefix = drafts[j][:cut]
        forked = decode(e, [Request(prompts[j], j, 4, length, prefix, fork=state)])
        again = decode(e, [Request(prompts[j], j, 4, length, prefix)])
        assert forked.completion(0)[0] == again.completion(0)[0], (name, j)
        assert (forked.completion(0)[1] - again.completion(0)[1]).abs().max() < LOGP_TOL


@pytest.mark.parametrize("temperature", [1.0, 1.01])
def test_the_engines_cut_is_the_scoring_paths_and_one_at_a_time_keeps_it(temperature):
    """Drafts of up to 40 tokens, verified over several chunks: cut early, or (temperature 1) kept whole."""
    e = engine(KVConfig())
    prompts, drafts, uniforms, got = drafts_and_states(e, temperature=temperature, length=40)
    scored = redraw(e.model, prompts, drafts, uniforms, temperature)
    *_, alone = drafts_and_states(e, batched=False, temperature=temperature, length=40)
    if temperature == 1.0:
        assert [cut for cut, _, _ in got] == list(map(len, drafts))
    for (cut, logp, _), (cut_scored, logp_scored), (cut_alone, _, _) in zip(got, scored, alone, strict=True):
        assert cut == cut_scored == cut_alone
        assert cut <= len(logp) and (logp - logp_scored[: len(logp)]).abs().max() < LOGP_TOL


def test_an_evicting_engine_is_refused():
    e = engine(KVConfig(method="snapkv", budget=14, window=3, interval=3))
    with pytest.raises(ValueError, match="evicting engine"), e.decoding():
        redraw_states(e, [[5, 6]], [[7]], [torch.zeros(1)], 1.0)
