"""A group's prompt KV held once (engine/shared_prefix.py) against the copied prompt, on tiny models.

SHARED_TOL: the sampler log-probs of shared-prefix and copied-prefix decoding, fp32 on CPU, differ by rounding
only (the prompt's scores and outputs are one matrix product per group instead of one per row, and the output
sums the prompt and own parts separately). Measured max |diff| over 2 archs x 3 model seeds x 2 temperatures
(1.0, 0.7) x 6 sampling seeds x 12 samples x 32 tokens: 2.0e-5 (1.3e-5 at T = 1), up to the first token drawn
differently. Tokens differed in 3 of 864 samples (1 in 9,000 tokens), each where the uniform fell within 1e-7 of
a boundary of the cumulative distribution (checked: logits 3e-6 apart), as between any two batch shapes
(docs/rollout.md). SHARED_TOL = 5e-5 is 2.5x the worst measured; a real error (a wrong position or mask, a
missed prefix) moves log-probs by 1e-2 or more.

Under block-sparse reads (block_topk, the prompt's whole pages held once with their page summaries, each row's
pages scored against them): measured max |diff| 1.8e-5 over 2 archs x 3 model seeds x page sizes 4 and 16 x 2
temperatures x 3 sampling seeds x 12 samples x 32 tokens, up to the first token drawn differently (1 of 864
samples), so the same SHARED_TOL holds.
"""

from __future__ import annotations

import pytest
import torch

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.decoding import Request, Sampling
from sparserl.engine.shared_prefix import SharedPrefixCache, shared_inputs
from sparserl.models import encode_prompt, tiny_model
from sparserl.rollout import Scheduler

SHARED_TOL = 5e-5  # shared vs copied prompt KV, fp32 CPU: measured max 2.0e-5 (module docstring)
LOGIT_TOL = 1e-4  # a fork's re-prefilled first-step logits vs its parent's decoded ones
ARCHS = ("llama", "qwen3")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    return tiny_model(request.param, seed=0)


def prompts_of(tok) -> list[list[int]]:
    """Three chat prompts of 28, 38 and 66 tokens."""
    return [encode_prompt(tok, [{"role": "user", "content": "Count: " + "ab" * k}]) for k in (1, 6, 20)]


def engines(model, tok) -> dict[bool, RolloutEngine]:
    out = {share: RolloutEngine(model, tok, share_prompts=share) for share in (True, False)}
    for e in out.values():
        e.eos_ids = set()  # every sample reaches max_new_tokens
    return out


def assert_same_samples(a, b) -> None:
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    for x, y in zip(a, b, strict=True):
        assert (x.logprobs - y.logprobs).abs().max() < SHARED_TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_decoding_equals_copied_prompt_decoding(tiny, temperature):
    model, tok = tiny
    e = engines(model, tok)
    shared = e[True].generate(prompts_of(tok), n=4, max_new_tokens=32, seed=3, temperature=temperature)
    copied = e[False].generate(prompts_of(tok), n=4, max_new_tokens=32, seed=3, temperature=temperature)
    assert_same_samples(shared, copied)
    assert shared.stats["held_positions_mean"] == copied.stats["held_positions_mean"]  # the prompt is read


def test_a_prefix_one_token_short_is_caught(tiny, monkeypatch):
    """The comparison can fail: rows reading their prompt less its last slot move log-probs past 1e-2."""
    model, tok = tiny
    e = engines(model, tok)
    hold = SharedPrefixCache.hold

    def short(self, tokens, src, row, logits):
        src.length[row] -= 1
        return hold(self, tokens, src, row, logits)

    monkeypatch.setattr(SharedPrefixCache, "hold", short)
    shared = e[True].generate(prompts_of(tok)[:1], n=2, max_new_tokens=8, seed=3)
    copied = e[False].generate(prompts_of(tok)[:1], n=2, max_new_tokens=8, seed=3)
    assert any(
        a.completion_ids != b.completion_ids or float((a.logprobs - b.logprobs).abs().max()) > 1e-2
        for a, b in zip(shared, copied, strict=True)
    )


def admitted_runs(engines_by_share: dict[bool, RolloutEngine], requests: list[Request]) -> dict:
    """A decoding run of each engine with every request admitted (nothing decoded yet)."""
    runs = {}
    for share, engine in engines_by_share.items():
        with engine.decoding():
            runs[share] = engine.start_run(requests, Sampling())
            runs[share].admit(list(range(len(requests))))
    return runs


def test_the_prompt_kv_is_held_once_not_copied(tiny):
    model, tok = tiny
    e = engines(model, tok)
    prompt, n, new = prompts_of(tok)[2], 16, 8
    runs = admitted_runs(e, [Request(prompt, key, 0, new) for key in range(n)])
    bpp = runs[True].bytes_per_position
    shared, copied = runs[True].cache, runs[False].cache
    assert isinstance(shared, SharedPrefixCache) and not isinstance(copied, SharedPrefixCache)
    assert len(shared.prefixes) == 1 and shared.shared_bytes() == len(prompt) * bpp
    assert int(shared.length.max()) == 0  # no row holds a prompt slot
    assert shared.nbytes() == len(prompt) * bpp + n * new * bpp  # the prompt once, each row its own tokens
    assert copied.nbytes() == n * (len(prompt) + new) * bpp  # n copies
    assert torch.equal(shared.held(), copied.held())  # both rows read the whole prompt


def test_groups_share_singletons_and_continuations_copy(tiny):
    model, tok = tiny
    a, b, c = prompts_of(tok)
    inputs = [tuple(x) for x in (a, a, b, b + [5, 6], c + [5, 6], c + [5, 6], c + [5])]
    assert shared_inputs(inputs) == {tuple(a), tuple(c + [5, 6])}  # groups and children forked at one token
    e = engines(model, tok)
    sparse = KVConfig(method="rkv", budget=24, window=4, interval=4)
    assert RolloutEngine(
        model, tok, kv=sparse
    ).share_prompts  # each row a mask over it (test_evicting_prefix)
    assert RolloutEngine(model, tok, kv=KVConfig(method="block_topk", budget=64)).share_prompts  # whole pages
    mixed = [
        Request(a, 0, 0, 6),
        Request(a, 1, 0, 6),
        Request(c, 2, 0, 6),
        Request(b, 3, 0, 6, prefix=[5, 6]),
    ]
    out = {}
    for share, engine in e.items():
        out[share], _, _ = Scheduler(engine).run(mixed, Sampling())
    assert len(out[True].cache.prefixes) == 0  # released once their rows finished
    for i in range(len(mixed)):
        (ta, la), (tb, lb) = out[True].completion(i), out[False].completion(i)
        assert ta == tb and (la - lb).abs().max() < SHARED_TOL


def test_children_forked_at_one_token_share_its_history_and_start_from_the_parents_logits(tiny):
    """Tree children (prompt + the parent's tokens up to the fork) hold that history once; their first-step
    logits are the parent's there (re-prefilled: measured 6.1e-6, LOGIT_TOL 1e-4) and they differ only by their
    streams: the child on the parent's stream continues the parent's tokens."""
    model, tok = tiny
    e = engines(model, tok)[True]
    prompt = prompts_of(tok)[1]
    with e.decoding():
        run = e.start_run([Request(prompt, 5, 0, 24)], Sampling())
        run.admit([0])
        for _ in range(10):
            run.step()
        parent_logits, history = run.logits[0].clone(), run.completion(0)[0]
        kids = e.start_run([Request(prompt, key, 0, 24, prefix=history) for key in (5, 6, 7)], Sampling())
        kids.admit([0, 1, 2])
        assert len(kids.cache.prefixes) == 1 and int(kids.cache.length.max()) == 0
        assert (kids.logits - parent_logits).abs().max() < LOGIT_TOL
        while kids.running:
            kids.step()
    whole = e.generate([prompt], n=1, max_new_tokens=24, seed=0, sample_keys=[5])
    assert history + kids.completion(0)[0] == whole[0].completion_ids
    assert kids.completion(1)[0] != kids.completion(0)[0] != kids.completion(2)[0]


@pytest.mark.parametrize("reads", ["dense", "block_topk"])
def test_under_a_cap_the_prompt_is_charged_once_and_samples_match(tiny, reads):
    """Continuous batching under a cap: a group admitted over several admissions reads the one held prompt
    (prefilled once), preempted samples come back as copies of prompt + tokens so far, and every sample is
    the copied run's."""
    model, tok = tiny
    e = engines(model, tok) if reads == "dense" else block_sparse(model, tok, 16)
    prompt = prompts_of(tok)[2]
    lengths = [140, 9, 60, 22, 150, 5, 50, 17]
    requests = [Request(prompt, key, 7, length) for key, length in enumerate(lengths)]
    bpp = e[True].start_run(requests, Sampling()).bytes_per_position
    cap = len(prompt) * bpp + 3 * 128 * bpp
    prefilled: list[list[int]] = []
    inner = e[True]._prefill
    e[True]._prefill = lambda inputs, *args: prefilled.extend(inputs) or inner(inputs, *args)
    seen: list[int] = []
    with e[True].step_hook(lambda step, cache, samples: seen.append(cache.nbytes())):
        shared, _, stats = Scheduler(e[True], cap).run(requests, Sampling())
    copied, _, _ = Scheduler(e[False]).run(requests, Sampling())
    assert stats.admissions > len(requests) and max(seen) <= cap
    for i in range(len(requests)):
        (ta, la), (tb, lb) = shared.completion(i), copied.completion(i)
        assert ta == tb and (la - lb).abs().max() < SHARED_TOL
    assert stats.preemptions >= 1 and len(prefilled) > 1  # a preempted sample came back as a copy
    assert prefilled.count(prompt) == 1  # every later admission read the prompt already held


def block_sparse(model, tok, page_size: int) -> dict[bool, RolloutEngine]:
    kv = KVConfig(method="block_topk", budget=6 * page_size, page_size=page_size, dense_layers=[0])
    out = {share: RolloutEngine(model, tok, kv=kv, share_prompts=share) for share in (True, False)}
    for e in out.values():
        e.eos_ids = set()
    return out


@pytest.mark.parametrize("page_size", [4, 16])
def test_block_sparse_reads_of_a_prompt_held_once_equal_copied_prompt_reads(tiny, page_size):
    """The prompt's whole pages held once (their summaries with them), its last partial page in each row: the
    same pages chosen and the same samples as rows holding a copy; steps do read fewer positions than held."""
    model, tok = tiny
    e = block_sparse(model, tok, page_size)
    shared = e[True].generate(prompts_of(tok), n=4, max_new_tokens=32, seed=3)
    copied = e[False].generate(prompts_of(tok), n=4, max_new_tokens=32, seed=3)
    assert_same_samples(shared, copied)
    assert shared.stats["read_positions_mean"] < shared.stats["held_positions_mean"]  # reads were sparse
    assert shared.stats["read_positions_mean"] == copied.stats["read_positions_mean"]


def test_block_sparse_prompt_is_held_once_as_whole_pages(tiny):
    model, tok = tiny
    e = block_sparse(model, tok, 16)
    prompt, n = prompts_of(tok)[2], 8  # 66 tokens: 4 whole pages held once, 2 tokens in each row
    with e[True].decoding():
        run = e[True].start_run([Request(prompt, key, 0, 8) for key in range(n)], Sampling())
        run.admit(list(range(n)))
    cache, bpp = run.cache, run.bytes_per_position
    (prefix,) = cache.prefixes.values()
    assert prefix.length == 64 and cache.shared_bytes() == len(prompt) * bpp  # the whole pages + the tail
    assert cache.length.tolist() == [2] * n and cache.held().tolist() == [len(prompt)] * n
    assert all(summaries.shape[1] == 4 for summaries in prefix.paged.values())


def test_block_sparse_prefix_pages_scored_wrongly_is_caught(tiny, monkeypatch):
    """The comparison can fail: prefix pages scored from zeroed summaries read other pages and move samples."""
    model, tok = tiny
    e = block_sparse(model, tok, 4)
    hold = SharedPrefixCache.hold

    def scrambled(self, tokens, src, row, logits):
        pid = hold(self, tokens, src, row, logits)
        for summaries in self.prefixes[pid].paged.values():
            summaries.normal_()
        return pid

    monkeypatch.setattr(SharedPrefixCache, "hold", scrambled)
    shared = e[True].generate(prompts_of(tok), n=2, max_new_tokens=16, seed=3)
    copied = e[False].generate(prompts_of(tok), n=2, max_new_tokens=16, seed=3)
    assert any(
        a.completion_ids != b.completion_ids or float((a.logprobs - b.logprobs).abs().max()) > 1e-3
        for a, b in zip(shared, copied, strict=True)
    )
