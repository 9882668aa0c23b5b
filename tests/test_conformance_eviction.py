"""The contract of every registered KV eviction method (EVICTION_METHODS) and page selector (SELECTORS), tested
over the registries' contents: a newly registered method is tested by registering it.

Eviction, on tiny models, every decode step observed through a `RolloutEngine` step hook: a sequence never holds
more than `budget + interval - 1` positions per layer, and holds exactly what the documented schedule says (a
prompt longer than `budget` is cut to `budget` after prefill; after every `interval`-th decode step a sequence that
held `budget` or more before the step holds exactly `budget`; otherwise it grows by one); its held positions are
unique, chronological, at their true RoPE positions, end with the last `window` ones and, where the method
`keeps_sinks`, start with the first `n_sink`; a budget that covers everything is the dense engine bit for bit;
each sequence of a ragged batch is compressed as if alone.

Page selectors, whose cache stays whole: every step reads, per KV head, page 0 and the 2 most recent pages plus
others, in order, at most the budget's worth; a budget that covers everything is the dense engine bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_topk import engine as paged_engine
from test_eviction import GRANULARITIES, engine, random_prompts

from sparserl.engine import EVICTION_METHODS, KVConfig, RolloutEngine
from sparserl.engine.cache import KVCache
from sparserl.engine.evicting_prefix import EvictingPrefixCache
from sparserl.engine.sparse_attention import SELECTORS
from sparserl.models import tiny_model

KEY_TOL = 1e-5  # a cached key vs the same key recomputed alone (batched vs single-row matmuls): ~1e-6


def layer0_keys(e: RolloutEngine, ids: list[int]) -> torch.Tensor:
    """Layer-0 keys [Hkv, T, D] of a sequence computed alone at positions 0..T-1 (they depend on token and
    position only), to check that a cached key was rotated by its true position."""
    dec = e.decoder
    x = torch.tensor(ids)[None]
    hidden = dec.embed(x)
    rope = dec.rope(hidden, torch.arange(len(ids))[None])
    return dec.qkv(0, hidden, rope).k[0]


# --- the bound, the schedule and true positions, at every step ---------------------------------------------


class StepChecker:
    """A step hook asserting, after every decode step, the bound, the schedule and the held positions."""

    def __init__(self, kv: KVConfig, prompt_lens: list[int], n: int, max_new: int):
        self.kv = kv
        self.prompt = [p for p in prompt_lens for _ in range(n)]
        self.held = [min(p, kv.budget) for p in self.prompt]  # a long prompt is cut right after prefill
        self.capacity = min(kv.budget + kv.interval - 1, max(prompt_lens) + max_new)
        self.steps = 0
        self.last: tuple | None = None

    def __call__(self, step: int, cache: KVCache, samples: torch.Tensor) -> None:
        kv = self.kv
        assert step == self.steps
        self.steps += 1
        if isinstance(cache, EvictingPrefixCache):  # own rows grow by blocks, never past the bound
            assert cache.capacity <= self.capacity
        else:
            assert cache.capacity == self.capacity
        assert all(t.shape[2] == cache.capacity for t in cache.k + cache.v + cache.pos)
        assert int(cache.held().max()) <= kv.budget + kv.interval - 1
        slots = [cache.eviction_slots(layer, slice(None)) for layer in range(cache.num_layers)]
        for row, s in enumerate(samples.tolist()):
            if (step + 1) % kv.interval == 0 and self.held[s] >= kv.budget:
                self.held[s] = kv.budget - 1  # cut so that the step's token makes exactly `budget`
            self.held[s] += 1
            held = int(cache.held()[row])
            assert held == self.held[s], (step, s, held, self.held[s])
            total = self.prompt[s] + step + 1  # positions fed so far; the newest is total - 1
            for layer in range(cache.num_layers):
                pos = slots[layer][1][row, :, :held].long()  # [Hkv, held], the prompt's held slots first
                assert (pos[:, 1:] > pos[:, :-1]).all(), "held positions are unique and chronological"
                assert pos.min() >= 0 and pos.max() == total - 1
                recent = torch.arange(max(0, total - kv.window), total)
                assert (pos[:, -len(recent) :] == recent).all(), "the last `window` positions are held"
                if EVICTION_METHODS[kv.method].keeps_sinks:
                    sinks = torch.arange(min(kv.n_sink, total))
                    assert (pos[:, : len(sinks)] == sinks).all()
                if kv.granularity == "shared":
                    assert (pos == slots[0][1][row, :1, :held].long()).all(), "one set for all heads, layers"
        keys, pos, _, held = slots[0]
        self.last = (step, keys.clone(), pos.clone(), held.clone(), samples.clone())


@pytest.mark.parametrize("method", sorted(EVICTION_METHODS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    granularity=st.sampled_from(GRANULARITIES),
    window=st.integers(1, 6),
    spare=st.integers(1, 12),
    interval=st.integers(1, 9),
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    n=st.integers(1, 2),
    max_new=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    share=st.booleans(),
)
def test_bound_schedule_and_positions_hold_at_every_step(
    method, granularity, window, spare, interval, prompt_lens, n, max_new, seed, share
):
    """Rows holding a copy of their prompt, or reading it held once (`share`: a mask over the cut prompt and
    their own slots; H2O's per-slot state keeps copies): the bound, schedule and positions of the held set."""
    sinks = KVConfig.n_sink if EVICTION_METHODS[method].keeps_sinks else 0
    kv = KVConfig(
        method=method,
        budget=window + sinks + spare,
        window=window,
        interval=interval,
        granularity=granularity,
        seed=seed,
    )
    e = engine(kv, share_prompts=share)
    check = StepChecker(kv, prompt_lens, n, max_new)
    e.step_hooks.append(check)
    prompts = random_prompts(prompt_lens, seed)
    out = e.generate(prompts, n=n, max_new_tokens=max_new, seed=seed)
    assert check.steps == max_new - 1  # the last sampled token is never fed
    bound = kv.budget + kv.interval - 1
    assert out.stats["peak_kv_positions"] <= bound
    assert max(s.stats["kv_peak_positions"] for s in out) == out.stats["peak_kv_positions"]
    per_position = out.stats["kv_bytes_per_position"]
    decode_bytes = len(prompts) * n * check.capacity * per_position
    prefill_bytes = len(prompts) * max(prompt_lens) * per_position  # the prompts' cache, until it is copied
    if not e.share_prompts or n == 1:  # copies: every row allocated the bound
        assert out.stats["peak_kv_bytes"] == decode_bytes
        assert out.stats["peak_kv_transient_bytes"] == decode_bytes + prefill_bytes
    if check.last is None:
        return
    # RoPE saw the true positions: each held layer-0 key equals the key recomputed at its position.
    step, k0, pos0, length, samples = check.last
    for row, s in enumerate(samples.tolist()):
        ids = prompts[s // n] + out[s].completion_ids[: step + 1]
        fresh = layer0_keys(e, ids)  # [Hkv, T, D]
        held = int(length[row])
        idx = pos0[row, :, :held].long()
        expected = torch.gather(fresh, 1, idx[..., None].expand(-1, -1, fresh.shape[-1]))
        torch.testing.assert_close(k0[row, :, :held], expected, atol=KEY_TOL, rtol=0)


# --- exactness at a large budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", sorted(EVICTION_METHODS))
def test_large_budget_equals_dense(method, granularity, arch):
    prompts = random_prompts([23, 5, 12], 1)
    kv = KVConfig(method=method, budget=64, window=4, interval=3, granularity=granularity)
    e = engine(kv, arch)
    sparse = e.generate(prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7)
    # the dense engine holding each group's prompt as the evicting one does: once, or copied (H2O)
    dense = engine(None, arch, share_prompts=e.share_prompts).generate(
        prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7
    )
    assert sparse.stats["compression_events"] == 0
    for a, b in zip(sparse, dense, strict=True):
        assert a.completion_ids == b.completion_ids
        assert torch.equal(a.logprobs, b.logprobs)


# --- per-sequence budgets in a ragged batch ---------------------------------------------------------------------


@functools.cache
def eos_prone_model():
    """The tiny model with its EOS logit raised, so that greedy samples end at different steps."""
    model, tok = tiny_model("llama", seed=0)
    bias = torch.zeros(model.lm_head.weight.shape[0])
    bias[tok.eos_token_id] = 1.5
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model, tok


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", sorted(EVICTION_METHODS))
def test_ragged_batch_compresses_each_sequence_as_if_alone(method, granularity):
    """Prompts of 3 to 40 tokens with a budget of 16, samples ending at different times: every sequence follows
    the schedule from its own length (padding never counts), and each prompt's greedy completion and statistics
    are those of the prompt run alone, so neighbours never use or free a sequence's budget. (`random` draws its
    scores for the whole batch at once, so only the schedule is compared for it.)"""
    model, tok = eos_prone_model()
    kv = KVConfig(method=method, budget=16, window=4, interval=5, granularity=granularity)
    e = RolloutEngine(model, tok, kv=kv)
    lens = [3, 40, 17, 9, 25]
    prompts = random_prompts(lens, 1)
    check = StepChecker(kv, lens, n=1, max_new=48)
    e.step_hooks.append(check)
    batch = e.generate(prompts, n=1, max_new_tokens=48, temperature=0)
    e.step_hooks.clear()
    lengths = [len(s.completion_ids) for s in batch]
    assert len(set(lengths)) >= 3 and "stop" in {s.finish_reason for s in batch}  # they end apart
    assert max(s.stats["compression_events"] for s in batch) >= 3
    assert check.steps == max(lengths) - 1
    if method == "random":
        return
    for i, p in enumerate(prompts):
        alone = e.generate([p], n=1, max_new_tokens=48, temperature=0)[0]
        assert batch[i].completion_ids == alone.completion_ids, i
        assert batch[i].stats == alone.stats, i


# --- page selectors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_a_selector_reads_the_always_read_pages_within_its_budget(name, share):
    """Every step and sparse layer, per row and KV head: the pages read are distinct, in order, within the row's
    pages, page 0 and the 2 most recent among them, as many as the budget allows (all of them when it covers
    the row); no step reads more positions than the budget (rows reading a prompt held once or a copy)."""
    kv = KVConfig(method=name, budget=16, page_size=4, dense_layers=[0])
    e = paged_engine(kv, share_prompts=share)
    calls, rank_pages = [], e.sparse.rank_pages

    def recording(scores: torch.Tensor, plan) -> torch.Tensor:
        pages = rank_pages(scores, plan)
        calls.append((plan, pages))
        return pages

    e.sparse.rank_pages = recording
    out = e.generate(random_prompts([30, 7, 18], 2), n=2, max_new_tokens=30, seed=1)
    assert len(calls) > 30 and out.stats["read_positions_peak"] <= kv.budget
    for plan, pages in calls:
        assert int(plan.read.max()) <= kv.budget
        for r in range(pages.shape[0]):
            n, allowed = int(plan.pages[r]), int(plan.budget_pages[r])
            always = set(range(n)) & {0, n - 2, n - 1}
            for h in range(pages.shape[1]):
                got = [p for p in pages[r, h].tolist() if p >= 0]
                assert got == sorted(set(got)) and set(got) <= set(range(n)), (r, h, got)
                assert always <= set(got) and len(got) == min(n, allowed), (r, h, got, n, allowed)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("schedule", [None, [[0, 48], [40, 64]]])
@pytest.mark.parametrize("name", sorted(SELECTORS))
def test_a_covering_page_budget_equals_dense_bit_for_bit(name, arch, schedule):
    prompts = random_prompts([23, 5, 12], 1)  # ragged; the longest sample reaches 23 + 24 = 47 positions
    # both with the prompt copied into each row (a prompt held once sums its attention in another order: within
    # SHARED_TOL of the copied one, tests/test_shared_prefix.py)
    dense = paged_engine(None, arch, share_prompts=False).generate(
        prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7
    )
    kv = KVConfig(method=name, budget=48, page_size=16, schedule=schedule, dense_layers=[0])
    sparse = paged_engine(kv, arch, share_prompts=False).generate(
        prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7
    )
    for a, b in zip(sparse, dense, strict=True):
        assert a.completion_ids == b.completion_ids
        assert torch.equal(a.logprobs, b.logprobs)
    assert sparse.stats["read_positions_mean"] == sparse.stats["held_positions_mean"]
