"""Each eviction method's rule on hand-made caches (which positions it keeps, per head or shared), split from
tests/test_eviction.py (the bound, exactness and ragged batches on tiny models)."""

from __future__ import annotations

import pytest
import torch
from test_eviction import engine, random_prompts

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.cache import KVCache
from sparserl.engine.compression import make_evictor
from sparserl.engine.compression.base import SlotView, window_attention
from sparserl.engine.compression.rkv import redundancy
from sparserl.models import tiny_model

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
