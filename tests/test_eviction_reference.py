"""SnapKV and R-KV scores against a plain, independent reference of the spec's numbered steps (sparse-rl.md
section 8), on a GQA model: in a direct `score` call and at every cut of a real sparse `generate`."""

from __future__ import annotations

import pytest
import torch
from test_eviction import GRANULARITIES, engine, random_prompts

from sparserl.engine import KVConfig
from sparserl.engine.cache import KVCache
from sparserl.engine.compression import make_evictor
from sparserl.engine.compression.base import SlotView
from sparserl.engine.compression.rkv import redundancy

# --- SnapKV and R-KV scores against a plain reference of the spec (section 8), on a GQA model ----------------


def reference_importance(keys, queries, protected: int, scale: float, kernel: int) -> torch.Tensor:
    """SnapKV's I [Hkv, C] for the C = L - protected candidates, from keys [Hkv, L, D] of the L held slots and
    the valid window queries [Hq, w, D], following the spec's steps one by one, one KV head at a time."""
    kv_heads, held, _ = keys.shape
    group = queries.shape[0] // kv_heads
    candidates = held - protected
    out = torch.zeros(kv_heads, candidates, dtype=torch.float64)
    for h in range(kv_heads):
        # 1. logits of the window queries of every query head of the group, against all held keys
        logits = torch.stack([queries[h * group + g] @ keys[h].T * scale for g in range(group)])  # [G, w, L]
        # 2. GQA pooling on the raw logits: max over the group's query heads
        group_logits = logits.max(dim=0).values  # [w, L]
        # 3. softmax over the candidate keys only, per query
        probs = group_logits[:, :candidates].softmax(dim=-1)
        # 4. mean over the window queries
        mean = probs.mean(dim=0)
        # 5. max-pool along positions: kernel `kernel`, stride 1, padding kernel // 2
        pad = kernel // 2
        for j in range(candidates):
            out[h, j] = mean[max(0, j - pad) : j + pad + 1].max()
    return out


def reference_redundancy(keys, protected: int, threshold: float) -> torch.Tensor:
    """R-KV's R [Hkv, C] from keys [Hkv, L, D] of all L held slots: S = K^ K^T with a zero diagonal; per row i,
    S[i, j*] = 0 with j* the most recent j with S_ij > threshold, or 0 if none; softmax over all L of the
    column means; the first C = L - protected entries."""
    kv_heads, held, _ = keys.shape
    out = torch.zeros(kv_heads, held - protected, dtype=torch.float64)
    for h in range(kv_heads):
        k = keys[h] / keys[h].norm(dim=-1, keepdim=True)
        sim = k @ k.T
        sim.fill_diagonal_(0)
        for i in range(held):
            near = (sim[i] > threshold).nonzero()
            sim[i, int(near.max()) if len(near) else 0] = 0
        out[h] = sim.mean(dim=0).softmax(dim=-1)[: held - protected]
    return out


def reference_scores(method: str, kv: KVConfig, keys, queries, protected: int, scale: float) -> torch.Tensor:
    """The spec's score [Hkv, C] of each candidate: SnapKV's I, or R-KV's lambda * I - (1 - lambda) * R."""
    keys, queries = keys.double(), queries.double()
    importance = reference_importance(keys, queries, protected, scale, kv.pool_kernel)
    if method == "snapkv":
        return importance
    lam = kv.rkv_lambda
    return lam * importance - (1 - lam) * reference_redundancy(keys, protected, kv.rkv_similarity_threshold)


def reference_kept(scores: torch.Tensor, held: int, target: int, protected: int, shared: bool) -> list:
    """Kept slots per KV head: the protected last slots and the best-scored candidates (ties: the older one);
    with shared granularity one set chosen from the scores summed over heads."""
    if shared:
        scores = scores.sum(dim=0, keepdim=True).expand_as(scores)
    kept = []
    for head in scores.tolist():
        best = sorted(range(len(head)), key=lambda j: (-head[j], j))[: target - protected]
        kept.append(sorted(best) + list(range(held - protected, held)))
    return kept


def snapshot(cache: KVCache, layer: int, rows: torch.Tensor | slice) -> dict[str, torch.Tensor]:
    """A copy of what scoring reads from one layer of the cache for the given rows."""
    idx = torch.arange(cache.rows)[rows]
    keys, _, _, held = cache.eviction_slots(layer, idx)  # a shared prompt's held slots first, then own ones
    return {
        "keys": keys.clone(),
        "queries": cache.queries[layer][idx].clone(),
        "length": held.clone(),
        "query_count": cache.query_count[idx].clone(),
    }


def row_inputs(snap: dict, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [Hkv, L, D] of a row's L held slots and its valid window queries [Hq, w', D] from a snapshot."""
    held = int(snap["length"][row])
    seen = min(int(snap["query_count"][row]), snap["queries"].shape[2])
    return snap["keys"][row, :, :held], snap["queries"][row, :, :seen]


SCORE_TOL = 1e-5  # fp32 implementation vs the fp64 reference: measured max 3.6e-7 over 2 archs x 6 seeds


def assert_scores_match(method: str, kv: KVConfig, snap: dict, scores: torch.Tensor, protected: int, scale):
    """Each row's candidate scores [Hkv, C] equal the reference's; returns the reference scores per row."""
    wanted = []
    for row in range(len(snap["length"])):
        keys, queries = row_inputs(snap, row)
        want = reference_scores(method, kv, keys, queries, protected, scale)
        got = scores[row, :, : want.shape[1]].double()
        torch.testing.assert_close(got, want, atol=SCORE_TOL, rtol=0)
        wanted.append(want)
    return wanted


@pytest.mark.parametrize("method", ["snapkv", "rkv"])
def test_scores_follow_the_spec_order_on_a_gqa_model(method):
    """A direct `score()` call on a tiny GQA model's real cache (two query heads per KV head, two ragged rows,
    both layers; the window protected as at a prefill-time cut and, one slot less, as at a decode-time cut):
    the scores equal the reference's and rank the candidates alike, per head and shared."""
    kv = KVConfig(method=method, budget=12, window=4)
    e = engine(KVConfig(method=method, budget=200, window=4))  # nothing is cut while the cache is recorded
    last = {}
    e.step_hooks.append(
        lambda step, cache, samples: last.update(
            snaps=[snapshot(cache, layer, slice(None)) for layer in range(cache.num_layers)]
        )
    )
    e.generate(random_prompts([40, 23], 2), n=1, max_new_tokens=7, seed=3)
    scorer = make_evictor(kv, e.decoder.scale).method
    for snap in last["snaps"]:
        span = int(snap["length"].max())
        slot = torch.arange(span)[None]
        for protected in (kv.window, kv.window - 1):
            view = SlotView(
                keys=snap["keys"][:, :, :span],
                positions=torch.zeros(snap["keys"].shape[:2] + (span,), dtype=torch.int32),
                held=slot < snap["length"][:, None],
                candidates=slot < (snap["length"] - protected)[:, None],
                queries=snap["queries"],
                num_queries=snap["query_count"].clamp(max=kv.window),
                extras={},
                scale=e.decoder.scale,
            )
            got = scorer.score(view)
            wanted = assert_scores_match(method, kv, snap, got, protected, e.decoder.scale)
            for row, want in enumerate(wanted):
                held = int(snap["length"][row])
                for shared in (False, True):
                    ours = reference_kept(got[row, :, : want.shape[1]], held, kv.budget, protected, shared)
                    assert ours == reference_kept(want, held, kv.budget, protected, shared)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", ["snapkv", "rkv"])
def test_generate_cuts_follow_the_spec_order(method, granularity):
    """Through a real sparse generate (ragged prompts, those longer than the budget cut after prefill, then
    decode-time cuts): at every cut the method's scores equal the reference's, computed from the cache as the
    cut found it, and every row and head keeps exactly the reference's slots."""
    kv = KVConfig(method=method, budget=16, window=4, interval=5, granularity=granularity)
    e = engine(kv)
    cuts, scores = [], []
    select, score = e.evictor.select, e.evictor.method.score

    def spy_select(cache, layer, rows, target, keep_recent):
        snap = snapshot(cache, layer, rows)
        slots = select(cache, layer, rows, target, keep_recent)
        cuts.append((snap, target, keep_recent, slots))
        return slots

    def spy_score(view):
        scores.append(score(view))
        return scores[-1]

    e.evictor.select, e.evictor.method.score = spy_select, spy_score
    e.generate(random_prompts([40, 9, 25], 4), n=2, max_new_tokens=30, seed=5)
    assert {keep for _, _, keep, _ in cuts} == {kv.window, kv.window - 1}  # prefill-time and decode-time cuts
    for (snap, target, protected, slots), got in zip(cuts, scores, strict=True):
        wanted = assert_scores_match(method, kv, snap, got, protected, e.decoder.scale)
        for row, want in enumerate(wanted):
            held = int(snap["length"][row])
            assert slots[row].tolist() == reference_kept(
                want, held, target, protected, granularity == "shared"
            )


@pytest.mark.parametrize("block", [1, 5, 128])
def test_rkv_redundancy_matches_the_spec_formula(block):
    """The vectorised redundancy (its near-duplicate search in blocks of any size) equals the reference on
    ragged rows, at the candidates; keys from few directions make many near-duplicates."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 2, 6, 8, generator=g)
    keys = base[:, :, torch.randint(0, 6, (23,), generator=g)] + 0.5 * torch.randn(2, 2, 23, 8, generator=g)
    lengths, protected = [23, 19], 3
    held = torch.arange(23)[None] < torch.tensor(lengths)[:, None]
    got = redundancy(keys, held, threshold=0.5, block=block)
    for row, length in enumerate(lengths):
        want = reference_redundancy(keys[row, :, :length].double(), protected, 0.5)
        torch.testing.assert_close(got[row, :, : length - protected].double(), want, atol=1e-6, rtol=1e-5)
