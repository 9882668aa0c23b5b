"""KV eviction on tiny models: the bound at every step, the schedule, true positions, dense equivalence, each
method's rule on hand-made caches, per-sequence budgets in ragged batches, bad input.

Every decode step is observed through a `RolloutEngine` step hook. The expected number of held positions of a
sequence is simulated from the documented schedule: a prompt longer than `budget` is cut to `budget` after
prefill; after every `interval`-th decode step a sequence that held `budget` or more before the step holds
exactly `budget`; otherwise it grows by one.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparserl.engine import EVICTION_METHODS, KVConfig, RolloutEngine
from sparserl.engine.cache import KVCache
from sparserl.engine.compression import make_evictor
from sparserl.engine.compression.base import SlotView, window_attention
from sparserl.engine.compression.rkv import redundancy
from sparserl.models import ModelLoadError, tiny_model

GRANULARITIES = ("per_head", "shared")
KEY_TOL = 1e-5  # a cached key vs the same key recomputed alone (batched vs single-row matmuls): ~1e-6


@functools.cache
def tiny(arch: str = "llama"):
    return tiny_model(arch, seed=0)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 250, (n,), generator=g).tolist() for n in lengths]


def engine(
    kv: KVConfig | None, arch: str = "llama", eos: bool = False, share_prompts: bool = True
) -> RolloutEngine:
    model, tok = tiny(arch)
    e = RolloutEngine(model, tok, kv=kv, share_prompts=share_prompts)
    if not eos:
        e.eos_ids = set()
    return e


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
        assert cache.capacity == self.capacity
        assert all(t.shape[2] == self.capacity for t in cache.k + cache.v + cache.pos)
        assert int(cache.length.max()) <= kv.budget + kv.interval - 1
        for row, s in enumerate(samples.tolist()):
            if (step + 1) % kv.interval == 0 and self.held[s] >= kv.budget:
                self.held[s] = kv.budget - 1  # cut so that the step's token makes exactly `budget`
            self.held[s] += 1
            held = int(cache.length[row])
            assert held == self.held[s], (step, s, held, self.held[s])
            total = self.prompt[s] + step + 1  # positions fed so far; the newest is total - 1
            for layer in range(cache.num_layers):
                pos = cache.pos[layer][row, :, :held].long()  # [Hkv, held]
                assert (pos[:, 1:] > pos[:, :-1]).all(), "held positions are unique and chronological"
                assert pos.min() >= 0 and pos.max() == total - 1
                recent = torch.arange(max(0, total - kv.window), total)
                assert (pos[:, -len(recent) :] == recent).all(), "the last `window` positions are held"
                if kv.method == "streaming_llm":
                    sinks = torch.arange(min(kv.n_sink, total))
                    assert (pos[:, : len(sinks)] == sinks).all()
                if kv.granularity == "shared":
                    assert (pos == cache.pos[0][row, :1, :held].long()).all(), "one set for all heads, layers"
        self.last = (step, cache.k[0].clone(), cache.pos[0].clone(), cache.length.clone(), samples.clone())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(EVICTION_METHODS),
    granularity=st.sampled_from(GRANULARITIES),
    window=st.integers(1, 6),
    spare=st.integers(1, 12),
    interval=st.integers(1, 9),
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    n=st.integers(1, 2),
    max_new=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_bound_schedule_and_positions_hold_at_every_step(
    method, granularity, window, spare, interval, prompt_lens, n, max_new, seed
):
    sinks = 4 if method == "streaming_llm" else 0
    kv = KVConfig(
        method=method,
        budget=window + sinks + spare,
        window=window,
        interval=interval,
        granularity=granularity,
        seed=seed,
    )
    e = engine(kv)
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


def test_long_prompt_is_cut_to_budget_right_after_prefill():
    kv = KVConfig(method="snapkv", budget=16, window=4, interval=8)
    e = engine(kv)
    seen = []
    e.step_hooks.append(lambda step, cache, samples: seen.append(cache.length.tolist()))
    out = e.generate(random_prompts([40, 10], 0), n=1, max_new_tokens=5)
    assert seen[0] == [17, 11]  # budget + the first generated token; the short prompt is untouched
    assert [s.stats["compression_events"] for s in out] == [1, 0]


def test_memory_is_allocated_for_the_bound_not_the_length():
    kv = KVConfig(method="rkv", budget=24, window=4, interval=8)
    out = engine(kv).generate(random_prompts([6], 0), n=3, max_new_tokens=120)
    dense = engine(None).generate(random_prompts([6], 0), n=3, max_new_tokens=120)
    per_position = out.stats["kv_bytes_per_position"]
    assert out.stats["peak_kv_bytes"] == 3 * (24 + 8 - 1) * per_position
    assert dense.stats["peak_kv_bytes"] == (6 + 3 * 120) * per_position  # the group's prompt held once
    # plus the prompt's prefilled 6 positions while they are copied to the samples
    assert out.stats["peak_kv_transient_bytes"] == (3 * (24 + 8 - 1) + 6) * per_position
    assert out.stats["peak_kv_positions"] == 24 + 8 - 1
    assert out.stats["compression_events"] == 3 * 12  # after steps 24, 32, ..., 112
    held, fractions = 6, []  # the schedule, simulated: held / total positions after each decode step
    for step in range(119):
        held = 23 if (step + 1) % 8 == 0 and held >= 24 else held
        held += 1
        fractions.append(held / (6 + step + 1))
    assert out.stats["retained_fraction"] == pytest.approx(sum(fractions) / len(fractions), rel=1e-5)
    assert 0 < out.stats["compress_s"] < out.stats["decode_s"]


# --- exactness at a large budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", EVICTION_METHODS)
def test_large_budget_equals_dense(method, granularity, arch):
    prompts = random_prompts([23, 5, 12], 1)
    # the dense engine with each group's prompt copied into its rows, as an evicting cache holds it
    dense = engine(None, arch, share_prompts=False).generate(
        prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7
    )
    kv = KVConfig(method=method, budget=64, window=4, interval=3, granularity=granularity)
    sparse = engine(kv, arch).generate(prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7)
    assert sparse.stats["compression_events"] == 0
    for a, b in zip(sparse, dense, strict=True):
        assert a.completion_ids == b.completion_ids
        assert torch.equal(a.logprobs, b.logprobs)


# --- each method's rule on hand-made caches -------------------------------------------------------------------


def hand_cache(
    keys: torch.Tensor, positions: list[int] | None = None, queries: torch.Tensor | None = None, extras=()
) -> KVCache:
    """A one-row cache holding `keys` [L, Hkv, S, D] (layers first), at `positions` (default 0..S-1), with
    window `queries` [L, Hq, w, D] (default: zeros, i.e. uniform attention)."""
    layers, hkv, s, d = keys.shape
    hq = queries.shape[1] if queries is not None else hkv
    w = queries.shape[2] if queries is not None else 2
    cache = KVCache(layers, 1, hkv, hq, d, s + 4, w, torch.float32, torch.device("cpu"), extras=extras)
    pos = torch.tensor(positions if positions is not None else list(range(s)))[None]
    for layer in range(layers):
        cache.fill(layer, keys[layer][None], torch.randn(1, hkv, s, d), pos, torch.tensor([s]))
        if queries is not None:
            cache.queries[layer][0] = queries[layer]
    cache.query_count = torch.tensor([w])
    return cache


def kept(cache: KVCache, layer: int = 0) -> list[list[int]]:
    """Held positions per KV head of the only row."""
    return cache.pos[layer][0, :, : int(cache.length[0])].tolist()


def evict(method: str, cache: KVCache, target: int, keep_recent: int, **cfg) -> KVCache:
    kv = KVConfig(method=method, budget=target, window=keep_recent, **cfg)
    make_evictor(kv, scale=1.0).compress(cache, torch.tensor([0]), target, keep_recent)
    return cache


def one_hot(*idx: int, d: int = 16, scale: float = 1.0) -> torch.Tensor:
    out = torch.zeros(len(idx), d)
    out[torch.arange(len(idx)), torch.tensor(idx)] = scale
    return out


def test_streaming_llm_keeps_sinks_and_recent_by_true_position():
    positions = [0, 1, 2, 3, 7, 9, 10, 12, 15, 16, 17, 18]  # an earlier cut left gaps
    cache = hand_cache(torch.randn(1, 2, 12, 8), positions)
    evict("streaming_llm", cache, target=9, keep_recent=3, n_sink=4)
    assert kept(cache) == [[0, 1, 2, 3, 12, 15, 16, 17, 18]] * 2


def test_h2o_keeps_heavy_hitters_per_head_or_shared():
    heavy = torch.zeros(2, 1, 2, 12)  # [layer, row, head, slot]
    heavy[0, 0, 0, [2, 5]] = torch.tensor([10.0, 9.0])
    heavy[0, 0, 1, [1, 6]] = torch.tensor([3.0, 2.0])
    heavy[1, 0, :, [0, 4]] = 50.0  # layer 1 disagrees; with shared granularity layer 0 decides
    for granularity, want in (
        ("per_head", [[2, 5, 10, 11], [1, 6, 10, 11]]),
        ("shared", [[2, 5, 10, 11]] * 2),
    ):
        cache = hand_cache(torch.randn(2, 2, 12, 8), extras=("attention",))
        for layer in range(2):
            cache.extras["attention"][layer][:, :, :12] = heavy[layer]
        evict("h2o", cache, target=4, keep_recent=2, granularity=granularity)
        assert kept(cache, 0) == want
        if granularity == "shared":
            assert kept(cache, 1) == want
        else:
            assert kept(cache, 1) == [[0, 4, 10, 11]] * 2
        # the kept slots carry their scores along; freed slots are zeroed for the tokens written there next
        assert cache.extras["attention"][0][0, 0, :4].tolist() == [heavy[0, 0, 0, j].item() for j in want[0]]
        assert cache.extras["attention"][0][0, :, 4:].abs().sum() == 0


def test_h2o_accumulates_all_attention_a_key_received():
    """After prefill and decoding, each key's H2O score is the attention it received from every query so far
    (summed over the query heads of its KV group), as the model's own eager attention reports it; padding
    queries of a shorter prompt in the batch add nothing."""
    model, tok = tiny_model("llama", seed=0)
    kv = KVConfig(method="h2o", budget=200, window=4)
    e = RolloutEngine(model, tok, kv=kv)
    e.eos_ids = set()
    snap = {}
    e.step_hooks.append(
        lambda step, cache, samples: snap.update(
            step=step, scores=[t.clone() for t in cache.extras["attention"]]
        )
    )
    prompts = random_prompts([17, 4], 3)
    out = e.generate(prompts, n=2, max_new_tokens=10)
    model.set_attn_implementation("eager")
    for row, sample in enumerate(out):
        ids = prompts[row // 2] + sample.completion_ids[: snap["step"] + 1]
        attn = model(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, Hq, T, T]
        for layer, a in enumerate(attn):
            want = a[0].view(2, 2, len(ids), len(ids)).sum(dim=(1, 2))  # [Hkv, key]
            got = snap["scores"][layer][row, :, : len(ids)]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_snapkv_keeps_what_the_window_queries_attend_to():
    keys = one_hot(*range(12), scale=8.0)[None, None]  # [1, 1, 12, 16]: key j points along axis j
    queries = one_hot(3, 7, scale=8.0)[None, None]  # the two window queries look at slots 3 and 7
    cache = evict("snapkv", hand_cache(keys, queries=queries), target=4, keep_recent=2, pool_kernel=1)
    assert kept(cache) == [[3, 7, 10, 11]]
    cache = evict("snapkv", hand_cache(keys, queries=queries), target=8, keep_recent=2, pool_kernel=3)
    assert kept(cache) == [[2, 3, 4, 6, 7, 8, 10, 11]]  # max-pooling keeps each attended key's neighbours


def test_window_attention_pools_gqa_logits_before_the_softmax_and_excludes_the_window():
    keys = one_hot(*range(10), scale=10.0)[None, None]  # one row, one KV head, 10 slots
    keys[0, 0, 9] = keys[
        0, 0, 3
    ]  # a window key equal to slot 3: it would take half of 3's mass if not excluded
    # two query heads share the KV head; head 0's queries look at 3 then 5, head 1's at 5 then 6
    queries = torch.stack([one_hot(3, 5, scale=10.0), one_hot(5, 6, scale=10.0)])[None]
    slot = torch.arange(10)[None]
    view = SlotView(
        keys=keys,
        positions=slot[None],
        held=slot < 10,
        candidates=slot < 8,  # the last two slots are the protected window
        queries=queries,
        num_queries=torch.tensor([2]),
        extras={},
        scale=1.0,
    )
    # max over the group's raw logits: query 0 peaks at 3 and 5, query 1 at 5 and 6; each softmax splits its
    # mass between its two peaks, and the mean over the two queries gives 3 -> 0.25, 5 -> 0.5, 6 -> 0.25
    # (a softmax per head before the max over the group would give 0.5 to each)
    want = torch.zeros(10)
    want[[3, 5, 6]] = torch.tensor([0.25, 0.5, 0.25])
    torch.testing.assert_close(window_attention(view)[0, 0], want, atol=1e-3, rtol=0)
    # only valid window queries count: with one query seen, slots 3 and 5 share all the mass
    view.num_queries = torch.tensor([1])
    want = torch.zeros(10)
    want[[3, 5]] = 0.5
    torch.testing.assert_close(window_attention(view)[0, 0], want, atol=1e-3, rtol=0)


def test_rkv_drops_older_duplicates_and_keeps_the_newest_copy():
    keys = one_hot(0, 15, 2, 3, 15, 5, 15, 7, 8, 9)[None, None]  # slots 1, 4, 6 hold the same key
    r = redundancy(keys, torch.ones(1, 10, dtype=torch.bool), threshold=0.5)[0, 0]
    assert r[1] > r[4] > r[6] and r[6] == pytest.approx(r[0].item())  # the newest copy looks unique
    # zero queries: uniform attention, so redundancy alone decides
    cache = evict("rkv", hand_cache(keys), target=9, keep_recent=2)
    assert kept(cache) == [[0, 2, 3, 4, 5, 6, 7, 8, 9]]  # the oldest copy goes first
    cache = evict("rkv", hand_cache(keys), target=8, keep_recent=2)
    assert kept(cache) == [[0, 2, 3, 5, 6, 7, 8, 9]]  # then the middle one; the newest stays


def test_rkv_importance_breaks_ties_between_unique_keys():
    keys = one_hot(*range(10), scale=6.0)[None, None]
    queries = one_hot(4, 4, scale=6.0)[None, None]
    cache = evict("rkv", hand_cache(keys, queries=queries), target=3, keep_recent=2, pool_kernel=1)
    assert kept(cache) == [[4, 8, 9]]


def test_random_is_seeded_and_reproducible():
    def choose(seed: int, generate_seed: int) -> list[list[int]]:
        cache = hand_cache(torch.randn(1, 2, 40, 8))
        kv = KVConfig(method="random", budget=10, window=2, seed=seed)
        ev = make_evictor(kv, 1.0)
        ev.method.start(generate_seed)
        ev.compress(cache, torch.tensor([0]), 10, 2)
        return kept(cache)

    assert choose(0, 5) == choose(0, 5)
    assert choose(0, 5) != choose(1, 5) and choose(0, 5) != choose(0, 6)
    a, b = choose(0, 5)
    assert a != b  # per-head granularity: each head draws its own set
    # a rollout is reproducible: the second call of the same engine gives the same samples as the first
    e = engine(KVConfig(method="random", budget=12, window=2, interval=3))
    first, second = (e.generate(random_prompts([20], 0), n=2, max_new_tokens=30, seed=1) for _ in range(2))
    assert [s.completion_ids for s in first] == [s.completion_ids for s in second]


def test_shared_granularity_uses_one_set_for_all_heads_and_layers():
    keys = torch.randn(3, 2, 30, 8)
    cache = evict("snapkv", hand_cache(keys, queries=torch.randn(3, 4, 2, 8)), 10, 2, granularity="shared")
    sets = [kept(cache, layer) for layer in range(3)]
    assert all(s == [sets[0][0]] * 2 for s in sets)
    cache = evict("snapkv", hand_cache(keys, queries=torch.randn(3, 4, 2, 8)), 10, 2, granularity="per_head")
    per_head = [h for layer in range(3) for h in kept(cache, layer)]
    assert len({tuple(h) for h in per_head}) > 1


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
@pytest.mark.parametrize("method", EVICTION_METHODS)
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


# --- bad input -----------------------------------------------------------------------------------------------


def test_budget_must_exceed_the_always_kept_positions():
    with pytest.raises(ValueError, match=r"kv.budget=8 .*window 8"):
        KVConfig(method="snapkv", budget=8, window=8)
    with pytest.raises(ValueError, match=r"kv.budget=12 .*window 8 \+ 4 sinks"):
        KVConfig(method="streaming_llm", budget=12, window=8)
    KVConfig(method="streaming_llm", budget=13, window=8)
    KVConfig(method="dense", budget=1, window=8)  # dense ignores the budget


def test_unknown_method_and_granularity_are_named():
    with pytest.raises(ValueError, match=r"kv.method='snap'.*rkv, snapkv"):
        KVConfig(method="snap")
    with pytest.raises(ValueError, match=r"kv.granularity='per_layer'"):
        KVConfig(method="rkv", granularity="per_layer")


@pytest.mark.parametrize(
    ("key", "value"), [("pool_kernel", 4), ("pool_kernel", 0), ("rkv_lambda", 1.5), ("n_sink", -1)]
)
def test_bad_method_knobs_are_named(key, value):
    with pytest.raises(ValueError, match=rf"kv.{key}={value}"):
        KVConfig(method="rkv", **{key: value})


def test_unsupported_attention_is_refused():
    _, tok = tiny()
    cfg = transformers.AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok), bos_token_id=1, eos_token_id=2
    )
    gpt2 = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        RolloutEngine(gpt2, tok, kv=KVConfig(method="rkv", budget=64))
