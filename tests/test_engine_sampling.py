"""The dense rollout engine's sampling on tiny models: stop strings and finish reasons, and the top-k / top-p
filters (the sampler's processed log-probs against a hand computation). Split from tests/test_engine.py, whose
tolerances apply."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import AGREE_TOL, ARCHS, LogitRecorder, chat, max_gap, no_eos, prompts_of, score_rollouts

from sparserl.engine import RolloutEngine
from sparserl.engine.sampling import processed_logprobs
from sparserl.models import tiny_model


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    return tiny_model(request.param, seed=0)


# ---------------------------------------------------------------- stop strings and finish reasons


def first_stop_end(tok, ids: list[int], stop: str) -> int | None:
    """Number of tokens up to and including the one that completes the first occurrence of `stop`."""
    for k in range(1, len(ids) + 1):
        if stop in tok.decode(ids[:k]):
            return k
    return None


def test_greedy_stop_string_ends_the_completion(tiny):
    model, tok = tiny
    engine = no_eos(RolloutEngine(model, tok))
    prompt = chat(tok, "Tell me a story.")
    full = engine.generate([prompt], max_new_tokens=40, temperature=0)[0].completion_ids
    # a two-character stop string spanning two tokens, taken from the middle of the greedy text
    printable = [
        j
        for j in range(6, len(full) - 4)
        if all(32 <= ord(c) < 127 for c in tok.decode(full[j : j + 2]))
        and len(tok.decode(full[j : j + 2])) == 2
    ]
    assert printable, f"no printable pair in {tok.decode(full)!r}"
    stop = tok.decode(full[printable[0] : printable[0] + 2])
    end = first_stop_end(tok, full, stop)
    assert end is not None and end < len(full)
    out = engine.generate([prompt], max_new_tokens=40, temperature=0, stop=[stop, "\x7f\x7f\x7f"])[0]
    assert out.finish_reason == "stop"
    assert out.completion_ids == full[:end]
    text = tok.decode(out.completion_ids)
    assert text.endswith(stop) or stop in tok.decode(out.completion_ids[-len(stop) - 1 :])
    assert stop not in tok.decode(out.completion_ids[:-1])
    assert out.logprobs.shape == (end,)


def test_sampled_stop_string_every_row(tiny):
    """With sampling: a row finishes with 'stop' exactly when its text reaches the stop string."""
    model, tok = tiny
    engine = no_eos(RolloutEngine(model, tok))
    prompts = prompts_of(tok)
    free = engine.generate(prompts, n=4, max_new_tokens=30, seed=5)
    counts: dict[str, int] = {}
    for s in free:
        for ch in set(tok.decode(s.completion_ids)):
            if ch.isalnum() and ch.isascii():
                counts[ch] = counts.get(ch, 0) + 1
    stops = sorted(counts, key=counts.get)[-4:]  # the ASCII characters that the most samples produce
    out = engine.generate(prompts, n=4, max_new_tokens=30, seed=5, stop=stops)
    stopped = 0
    for s in out:
        text = tok.decode(s.completion_ids)
        if s.finish_reason == "stop":
            stopped += 1
            assert any(x in text for x in stops)
            assert not any(x in tok.decode(s.completion_ids[:-1]) for x in stops)
        else:
            assert s.finish_reason == "length" and len(s.completion_ids) == 30
            assert not any(x in text for x in stops)
    assert stopped >= len(out) // 2
    assert (
        max_gap(out, score_rollouts(model, prompts, out)) < AGREE_TOL
    )  # finished rows left the batch cleanly


def test_length_finish_when_max_new_tokens_is_hit(tiny):
    model, tok = tiny
    out = no_eos(RolloutEngine(model, tok)).generate(prompts_of(tok), n=2, max_new_tokens=9, seed=0)
    assert all(s.finish_reason == "length" and len(s.completion_ids) == 9 for s in out)
    assert out.stats["generated_tokens"] == 9 * len(out)


def eos_biased(arch: str, bias: float):
    """A tiny model whose EOS logit is raised by `bias` at every position (a hook on the LM head)."""
    model, tok = tiny_model(arch, seed=1)
    shift = torch.zeros(len(tok))
    shift[tok.eos_token_id] = bias
    model.lm_head.register_forward_hook(lambda mod, args, out: out + shift)
    return model, tok


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_finishes_with_stop_and_rows_leave_cleanly(arch):
    model, tok = eos_biased(arch, 4.0)
    prompts = [chat(tok, "hello"), chat(tok, "a longer prompt " * 4)]
    engine = RolloutEngine(model, tok)
    assert tok.eos_token_id in engine.eos_ids
    out = engine.generate(prompts, n=6, max_new_tokens=24, seed=2)
    reasons = {s.finish_reason for s in out}
    assert reasons == {"stop", "length"}, "the bias should end some samples early and leave others running"
    for s in out:
        eos_at = [i for i, t in enumerate(s.completion_ids) if t in engine.eos_ids]
        if s.finish_reason == "stop":
            assert eos_at == [len(s.completion_ids) - 1]  # ends on its first EOS
        else:
            assert eos_at == [] and len(s.completion_ids) == 24
    # the samples still running after others finished see exactly their own context
    assert max_gap(out, score_rollouts(model, prompts, out)) < AGREE_TOL
    assert out.stats["generated_tokens"] == sum(len(s.completion_ids) for s in out)


def test_eos_certain_gives_one_token_completions():
    model, tok = eos_biased("llama", 60.0)
    out = RolloutEngine(model, tok).generate([chat(tok, "hi")], n=3, max_new_tokens=8)
    assert all(s.completion_ids == [tok.eos_token_id] and s.finish_reason == "stop" for s in out)
    assert all(abs(float(s.logprobs[0])) < 1e-6 for s in out)


# ---------------------------------------------------------------- top-k / top-p


def reference_logprobs(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """Hand computation, one row at a time in float64: keep the top-k, then the smallest nucleus >= top_p.

    top_p = 1 means no nucleus cut (as in the sampler): a float64 running mass can reach 1.0 before the last token.
    """
    out = torch.full(logits.shape, float("-inf"), dtype=torch.float64)
    for r, row in enumerate(logits.double() / temperature):
        order = row.argsort(descending=True).tolist()
        kept = order[:top_k] if 0 < top_k < len(order) else order
        probs = torch.softmax(row[kept], dim=0)
        mass, nucleus = 0.0, []
        for idx, p in zip(kept, probs.tolist(), strict=True):
            nucleus.append(idx)
            mass += p
            if top_p < 1.0 and mass >= top_p:
                break
        out[r, nucleus] = torch.log_softmax(row[nucleus], dim=0)
    return out


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [(1.0, 1.0, 5), (0.7, 1.0, 3), (1.0, 0.6, 0), (0.5, 0.9, 0), (1.3, 0.8, 10), (1.0, 1e-6, 0)],
)
def test_processed_logprobs_match_hand_computation(temperature, top_p, top_k):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    got = processed_logprobs(logits, temperature, top_p, top_k)
    want = reference_logprobs(logits, temperature, top_p, top_k)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = torch.isfinite(want)
    assert (got[kept].double() - want[kept]).abs().max() < 1e-5
    assert torch.allclose(got.exp().sum(-1), torch.ones(6), atol=1e-5)  # renormalised
    if top_k:
        assert bool((kept.sum(-1) <= top_k).all())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(2, 40),
    temperature=st.floats(0.2, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 45),
)
def test_processed_logprobs_property(seed, vocab, temperature, top_p, top_k):
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    got = processed_logprobs(logits, temperature, top_p, top_k)
    want = reference_logprobs(logits, temperature, top_p, top_k)
    # skip a nucleus boundary within float32 rounding of top_p (both answers are then right)
    probs = torch.softmax(torch.where(torch.isinf(want), float("-inf"), logits.double() / temperature), -1)
    cum = probs.sort(-1, descending=True).values.cumsum(-1)
    if top_p < 1.0 and bool(((cum - top_p).abs() < 1e-5).any()):
        return
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    kept = torch.isfinite(want)
    assert (got[kept].double() - want[kept]).abs().max() < 1e-4
    assert bool((kept.sum(-1) >= 1).all())


@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 4), (0.5, 0), (0.8, 6)])
def test_engine_samples_inside_top_k_top_p_with_renormalised_logprobs(tiny, monkeypatch, top_p, top_k):
    model, tok = tiny
    engine = no_eos(RolloutEngine(model, tok))
    rec = LogitRecorder(monkeypatch)
    temperature = 0.8
    out = engine.generate(prompts_of(tok), n=3, max_new_tokens=12, temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=4)  # fmt: skip
    for step, logits in enumerate(rec.steps):
        want = reference_logprobs(logits, temperature, top_p, top_k)
        for row, s in enumerate(out):
            token = s.completion_ids[step]
            assert torch.isfinite(want[row, token]), f"step {step}: token {token} outside top-k/top-p"
            assert abs(float(s.logprobs[step]) - float(want[row, token])) < 1e-5
    if top_k:  # the filter is active: full-distribution log-probs are lower than the renormalised ones
        full = score_rollouts(model, prompts_of(tok), out, temperature)
        assert all(bool((s.logprobs >= f - AGREE_TOL).all()) for s, f in zip(out, full, strict=True))
        assert max_gap(out, full) > 1e-3
