"""A group's cut prompt held once under an evicting cache (engine/evicting_prefix.py) against copies of it, on
tiny models.

Tolerance: test_shared_prefix.SHARED_TOL (5e-5). Measured max |diff| of the sampler log-probs, shared vs copied,
fp32 on CPU, over 2 archs x 4 methods (rkv, snapkv, streaming_llm, random) x 2 granularities x 2 budgets (24: the
prompts cut at prefill; 48: one kept whole) x 3 sampling seeds x 12 samples x 32 tokens: 1.3e-5, up to the first
token drawn differently (3 of 1,152 samples; before it the two distributions agreed within that 1.3e-5, a uniform
at a boundary of the cumulative distribution, as between any two batch shapes): the same sets of slots are read,
summed in another order.
"""

from __future__ import annotations

import pytest
import torch
from test_shared_prefix import SHARED_TOL, admitted_runs, prompts_of

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.decoding import Request, Sampling
from sparserl.engine.evicting_prefix import HELD, EvictingPrefixCache
from sparserl.engine.shared_prefix import PREFIX, SharedPrefixCache
from sparserl.models import encode_prompt, tiny_model
from sparserl.rollout import Scheduler


@pytest.fixture(scope="module", params=("llama", "qwen3"))
def tiny(request):
    return tiny_model(request.param, seed=0)


def engines(model, tok, kv: KVConfig) -> dict[bool, RolloutEngine]:
    out = {share: RolloutEngine(model, tok, kv=kv, share_prompts=share) for share in (True, False)}
    for e in out.values():
        e.eos_ids = set()  # every sample reaches max_new_tokens
    return out


def assert_same(a, b) -> None:
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert max(float((x.logprobs - y.logprobs).abs().max()) for x, y in zip(a, b, strict=True)) < SHARED_TOL


@pytest.mark.parametrize("granularity", ["per_head", "shared"])
@pytest.mark.parametrize("method", ["rkv", "snapkv", "streaming_llm", "random"])
@pytest.mark.parametrize("budget", [24, 48])
def test_children_evicting_from_a_prompt_held_once_sample_as_copies_do(tiny, method, granularity, budget):
    model, tok = tiny
    kv = KVConfig(method=method, budget=budget, window=4, interval=4, granularity=granularity)
    e = engines(model, tok, kv)
    assert e[True].share_prompts
    held: list[float] = []
    hook = lambda step, cache, samples: held.append(float(cache.row_state[HELD].any(-1).float().mean()))  # noqa: E731
    with e[True].step_hook(hook):
        shared = e[True].generate(prompts_of(tok), n=4, max_new_tokens=32, seed=3)
    copied = e[False].generate(prompts_of(tok), n=4, max_new_tokens=32, seed=3)
    assert_same(shared, copied)
    assert shared.stats["held_positions_mean"] == copied.stats["held_positions_mean"]
    assert held[0] == 1.0 and held[len(held) // 2] > 0.0  # rows read prompt slots after cuts


def test_reading_prompt_slots_a_row_evicted_is_caught(tiny, monkeypatch):
    """The comparison can fail: attention over the whole held prompt (no mask) moves log-probs past 1e-2."""
    model, tok = tiny
    e = engines(model, tok, KVConfig(method="snapkv", budget=24, window=4, interval=4))
    monkeypatch.setattr(EvictingPrefixCache, "attention", SharedPrefixCache.attention)
    shared = e[True].generate(prompts_of(tok)[2:], n=4, max_new_tokens=16, seed=3)
    copied = e[False].generate(prompts_of(tok)[2:], n=4, max_new_tokens=16, seed=3)
    assert any(
        a.completion_ids != b.completion_ids or float((a.logprobs - b.logprobs).abs().max()) > 1e-2
        for a, b in zip(shared, copied, strict=True)
    )


def test_per_slot_state_keeps_copies(tiny):
    model, tok = tiny
    assert not RolloutEngine(model, tok, kv=KVConfig(method="h2o", budget=24)).share_prompts


def test_rows_hold_their_own_tokens_beside_the_prompt_once_and_never_more_than_the_bound(tiny):
    """A 210-token prompt cut to 160 is held once; 8 readers hold only their own tokens, in a row that grows
    by blocks (128 slots first) instead of the bound (160 + 64 - 1 = 223) from the start; every row always
    holds at most the bound, prompt slots included; the prompt is dropped once no row reads it."""
    model, tok = tiny
    prompt = encode_prompt(tok, [{"role": "user", "content": "Count: " + "ab" * 90}])
    kv = KVConfig(method="snapkv", budget=160, window=4, interval=64)
    e = engines(model, tok, kv)
    n, new = 8, 150
    requests = [Request(prompt, key, 0, new) for key in range(n)]
    runs = admitted_runs(e, requests)
    bpp, cache = runs[True].bytes_per_position, runs[True].cache
    assert len(prompt) > 200 and isinstance(cache, EvictingPrefixCache)
    assert cache.shared_bytes() == 160 * bpp and int(cache.length.max()) == 0
    assert cache.nbytes() == 160 * bpp + n * 128 * bpp  # the cut prompt once, 128-slot rows
    assert runs[False].cache.nbytes() == n * 223 * bpp  # copies: the bound in every row
    assert torch.equal(cache.held(), runs[False].cache.held())
    most: list[int] = []
    with e[True].step_hook(lambda step, c, samples: most.append(int(c.held().max()))):
        out, _, _ = Scheduler(e[True]).run(requests, Sampling())
    copied, _, _ = Scheduler(e[False]).run(requests, Sampling())
    assert max(most) <= 223 and max(most) > 160
    for i in range(n):
        (ta, la), (tb, lb) = out.completion(i), copied.completion(i)
        assert ta == tb and (la - lb).abs().max() < SHARED_TOL


def test_a_row_holding_no_prompt_slot_stops_reading_it(tiny):
    model, tok = tiny
    e = engines(model, tok, KVConfig(method="streaming_llm", budget=24, window=4, interval=4, n_sink=0))
    prompt = prompts_of(tok)[2]
    requests = [Request(prompt, key, 0, 48) for key in range(3)]
    with e[True].decoding():
        run = e[True].start_run(requests, Sampling())
        run.admit([0, 1, 2])
        assert len(run.cache.prefixes) == 1
        for _ in range(40):  # StreamingLLM without sinks keeps the newest: the prompt goes after 24 tokens
            run.step()
        assert len(run.cache.prefixes) == 0 and not run.cache.row_state[PREFIX].any()
        assert torch.equal(run.cache.held(), run.cache.length)


def test_under_a_cap_the_cut_prompt_is_charged_once_and_samples_match(tiny):
    """Continuous batching under a cap: the 66-token prompt is charged as the 24 positions it is cut to, rows at
    their bound (27 slots); preempted samples come back as copies; every sample is the copied run's."""
    model, tok = tiny
    e = engines(model, tok, KVConfig(method="snapkv", budget=24, window=4, interval=4))
    prompt = prompts_of(tok)[2]
    requests = [Request(prompt, key, 7, length) for key, length in enumerate([40, 9, 30, 22, 45, 5, 35, 17])]
    run = e[True].start_run(requests, Sampling())
    bpp = run.bytes_per_position
    assert len(prompt) == 66 and run.shared_bytes_after_admit([0, 1]) == 24 * bpp
    cap = 24 * bpp + 3 * 27 * bpp
    seen: list[int] = []
    with e[True].step_hook(lambda step, cache, samples: seen.append(cache.nbytes())):
        shared, _, stats = Scheduler(e[True], cap).run(requests, Sampling())
    copied, _, _ = Scheduler(e[False]).run(requests, Sampling())
    assert stats.admissions > 3 and max(seen) <= cap
    for i in range(len(requests)):
        (ta, la), (tb, lb) = shared.completion(i), copied.completion(i)
        assert ta == tb and (la - lb).abs().max() < SHARED_TOL
