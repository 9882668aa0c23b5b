"""Block-sparse attention (kv.method=block_topk) on hand-made caches and tiny models: the page rule, the gathered
attention, the page summaries kept during decoding, per-row pages in a ragged batch, the positions-read statistics
and bad input (what every registered selector must do, dense equivalence at a covering budget included, is
tests/test_conformance_eviction.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.cache import KVCache
from sparserl.engine.decoder import decode_attention
from sparserl.engine.sparse_attention import SELECTORS, BlockTopK, PageSparseAttention, make_sparse_attention
from sparserl.engine.sparse_attention.base import StepPlan, summary_key
from sparserl.errors import UserError
from sparserl.models import tiny_model


@functools.cache
def tiny(arch: str = "llama"):
    return tiny_model(arch, seed=0, num_layers=3)  # layers 0 and 1 dense by default, layer 2 block-sparse


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 250, (n,), generator=g).tolist() for n in lengths]


def engine(kv: KVConfig | None, arch: str = "llama", share_prompts: bool = True) -> RolloutEngine:
    model, tok = tiny(arch)
    e = RolloutEngine(model, tok, kv=kv, share_prompts=share_prompts)
    e.eos_ids = set()
    return e


def page_cache(page_keys: torch.Tensor, tokens: int, page_size: int) -> KVCache:
    """A one-layer cache whose rows hold `tokens[r]` positions; every key of page p of row r, head h is
    `page_keys[r, h, p]` (so that is the page's centroid)."""
    rows, hkv, pages, d = page_keys.shape
    keys = page_keys.repeat_interleave(page_size, dim=2)
    cache = KVCache(1, rows, hkv, hkv * 2, d, pages * page_size, 2, torch.float32, torch.device("cpu"))
    cache.fill(
        0, keys, torch.randn_like(keys), torch.arange(pages * page_size)[None].expand(rows, -1), tokens
    )
    return cache


def reader(page_size: int, budget: int = 64, num_layers: int = 1) -> PageSparseAttention:
    kv = KVConfig(method="block_topk", budget=budget, page_size=page_size, dense_layers=[])
    return make_sparse_attention(kv, num_layers)


# --- the rule on hand-made caches -----------------------------------------------------------------------------


def test_selection_on_a_hand_made_cache_follows_the_rule():
    """Row 0: 15 tokens in pages of 2 -> pages 0..7, page 7 partial (being written). Budget 5 pages: page 0, pages
    6 and 7, and the 2 best-scored of pages 1..5. Row 1: 6 tokens, 3 pages, covered by its budget: all read."""
    d = 4
    keys = torch.zeros(2, 2, 8, d)
    keys[0, 0, :, 0] = torch.tensor([9.0, 1, 5, 2, 4, 3, -9, -9])  # head 0 (dim 0): best pages 2 and 4
    keys[0, 1, :, 1] = torch.tensor([-9.0, 3, 3, 1, 3, 0, 9, 9])  # head 1 (dim 1): a tie, the older 1, 2 win
    q = torch.zeros(2, 4, 1, d)  # 2 query heads per KV head; q_bar is their mean
    q[:, 0, 0, 0], q[:, 1, 0, 0] = 3.0, -1.0  # head 0: q_bar = e0
    q[:, 2, 0, 1], q[:, 3, 0, 2] = 2.0, 50.0  # head 1: q_bar = e1 + 25 e2 (dim 2 is 0 in every centroid)
    cache = page_cache(keys, torch.tensor([15, 6]), page_size=2)
    attn = reader(page_size=2)
    attn.start(cache)
    plan = StepPlan.make(torch.tensor([15, 6]), torch.tensor([10, 10]), page_size=2)
    pages = attn.select_pages(cache.row_state[summary_key(0)], q, plan)
    assert pages.tolist() == [[[0, 2, 4, 6, 7], [0, 1, 2, 6, 7]], [[0, 1, 2, -1, -1]] * 2]
    assert plan.read.tolist() == [15 - 3 * 2, 6]  # three full pages skipped; the short row reads all
    assert plan.width == 5


def test_mean_of_the_group_queries_not_the_best_head():
    """A page one query head likes a lot but the group's mean dislikes is not read."""
    keys = torch.zeros(1, 1, 5, 2)
    keys[0, 0, 1] = torch.tensor([4.0, -4.0])  # head a (e0) scores 4, head b (e1) -4: mean 0
    keys[0, 0, 2] = torch.tensor([1.0, 1.0])  # both score 1: mean 1
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])[None, :, None, :]  # [1, 2 heads, 1, 2]
    cache = page_cache(keys, torch.tensor([10]), page_size=2)
    attn = reader(page_size=2, budget=8)
    attn.start(cache)
    plan = StepPlan.make(torch.tensor([10]), torch.tensor([8]), page_size=2)
    assert attn.select_pages(cache.row_state[summary_key(0)], q, plan).tolist() == [[[0, 2, 3, 4]]]


def test_gathered_attention_equals_the_masked_dense_attention():
    """read() gathers the chosen pages; attending to them equals attending to all slots with a per-head mask."""
    g = torch.Generator().manual_seed(0)
    rows, hkv, d, ps = 3, 2, 8, 4
    keys = torch.randn(rows, hkv, 40, d, generator=g)
    cache = KVCache(1, rows, hkv, 2 * hkv, d, 40, 2, torch.float32, torch.device("cpu"))
    tokens = torch.tensor([37, 22, 9])
    cache.fill(
        0, keys, torch.randn(rows, hkv, 40, d, generator=g), torch.arange(40)[None].expand(rows, -1), tokens
    )
    attn = reader(page_size=ps, budget=16)
    attn.start(cache)
    attn.begin_step(tokens, torch.tensor([16, 16, 16]))
    q = torch.randn(rows, 2 * hkv, 1, d, generator=g)
    span = int(tokens.max())
    k, v = cache.view(0, span)
    valid = cache.valid(span)
    k_read, v_read, mask = attn.read(cache, 0, q, k, v, valid)
    pages = attn.select_pages(cache.row_state[summary_key(0)], q, attn.plan)
    n_pages = -(-span // ps)
    page_mask = torch.zeros(rows, hkv, n_pages + 1, dtype=torch.bool)  # the last column takes the -1 padding
    page_mask.scatter_(-1, torch.where(pages >= 0, pages, n_pages), True)
    full_mask = page_mask[..., :n_pages].repeat_interleave(ps, dim=-1)[..., :span] & valid[:, None]
    assert full_mask.sum(-1)[:, 0].tolist() == attn.plan.read.tolist() == [16 - 4 + 1, 16 - 4 + 2, 9]
    assert mask.sum(-1)[:, 0].tolist() == attn.plan.read.tolist()
    out, _ = decode_attention(q, k_read, v_read, mask, scale=0.3)
    expected, _ = decode_attention(q, k, v, full_mask, scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


# --- through the engine ---------------------------------------------------------------------------------------


class PageRecorder:
    """Wraps a reader's select_pages to keep, per call, the cache keys of the layer, the queries, the plan and the
    pages chosen; `check` recomputes the rule from the raw keys (centroids from scratch, float64)."""

    def __init__(self, attn: PageSparseAttention, cache_holder: list):
        self.attn, self.calls, self.cache_holder = attn, [], cache_holder
        original = attn.select_pages

        def recording(summaries, q, plan):
            pages = original(summaries, q, plan)
            layer = next(
                i for i in attn.sparse_layers if cache_holder[0].row_state[summary_key(i)] is summaries
            )
            self.calls.append((cache_holder[0].k[layer].clone(), q.clone(), plan, pages))
            return pages

        attn.select_pages = recording

    def check(self, page_size: int) -> int:
        for k, q, plan, pages in self.calls:
            rows, hkv = k.shape[:2]
            for r in range(rows):
                n_pages = int(plan.pages[r])
                top = int(plan.budget_pages[r]) - 3
                for h in range(hkv):
                    q_bar = q[r, h * 2 : h * 2 + 2, 0].double().mean(0)
                    scores = {
                        p: float(k[r, h, p * page_size : (p + 1) * page_size].double().mean(0) @ q_bar)
                        for p in range(1, n_pages - 2)
                    }
                    best = sorted(scores, key=lambda p: (-scores[p], p))[: max(top, 0)]
                    expected = sorted({0, n_pages - 2, n_pages - 1, *best} & set(range(n_pages)))
                    got = [p for p in pages[r, h].tolist() if p >= 0]
                    assert got == expected, (r, h, got, expected)
        return len(self.calls)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_reads_the_pages_the_rule_picks_from_summaries_kept_while_decoding(arch):
    """Prompt pages are summarised after prefill and the others when they fill during decoding: the pages chosen
    at every step and sparse layer match the rule recomputed from the cached keys."""
    kv = KVConfig(method="block_topk", budget=24, page_size=4, dense_layers=[0])
    # rows holding their prompts: each row's cache keys are every position the rule scores (a prompt held once
    # reads the same pages: tests/test_shared_prefix.py)
    e = engine(kv, arch, share_prompts=False)
    holder: list = [None]
    original_run = e.start_run

    def start_run(*args, **kwargs):  # the decoding cache, which the prompts' rows join after prefill
        run = original_run(*args, **kwargs)
        holder[0] = run.cache
        return run

    e.start_run = start_run
    recorder = PageRecorder(e.sparse, holder)
    out = e.generate(random_prompts([30, 7, 18], 2), n=2, max_new_tokens=30, seed=1)
    assert recorder.check(page_size=4) > 30
    assert out.stats["read_positions_peak"] <= 24


def test_a_small_budget_changes_the_samples():
    """The sparse path is taken: with 3 pages of 4 out of up to 55 positions, log-probs move."""
    prompts = random_prompts([31, 12], 1)
    dense = engine(None).generate(prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7)
    kv = KVConfig(method="block_topk", budget=12, page_size=4, dense_layers=[0])
    sparse = engine(kv).generate(prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7)
    gap = max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(sparse, dense, strict=True))
    assert gap > 1e-2


def test_each_row_gets_its_own_pages_in_a_ragged_batch():
    """Greedy decoding: a prompt alone and beside a longer one reads the same pages (same tokens)."""
    kv = KVConfig(method="block_topk", budget=16, page_size=4, dense_layers=[0])
    prompts = random_prompts([9, 33], 4)
    both = engine(kv).generate(prompts, n=1, max_new_tokens=40, temperature=0.0)
    alone = [engine(kv).generate([p], n=1, max_new_tokens=40, temperature=0.0)[0] for p in prompts]
    for a, b in zip(both, alone, strict=True):
        assert a.completion_ids == b.completion_ids


def test_positions_read_statistics():
    """One prompt of 10, pages of 4, budget 16: a step whose sequence fills more than 4 pages reads the 3 newest
    whole-or-partial ones' worth plus page 0; the held positions grow by one per step."""
    kv = KVConfig(method="block_topk", budget=16, page_size=4, dense_layers=[0])
    e = engine(kv)
    reads = []
    e.step_hooks.append(lambda step, cache, samples: reads.append(e.sparse.plan.read.tolist()))
    out = e.generate(random_prompts([10], 0), n=2, max_new_tokens=30)
    held = [10 + s + 1 for s in range(29)]
    expected = [t if -(-t // 4) <= 4 else t - (-(-t // 4) - 4) * 4 for t in held]
    assert reads == [[r, r] for r in expected]
    assert max(expected) == 16 and min(expected[6:]) == 13  # 3 whole pages + a partial one of 1..4
    stats = out.stats
    assert stats["read_positions_mean"] == pytest.approx(sum(expected) / len(expected))
    assert stats["read_positions_peak"] == 16
    assert stats["held_positions_mean"] == pytest.approx(sum(held) / len(held))
    assert stats["peak_kv_positions"] == 39
    for s in out:
        assert s.stats["read_positions_mean"] == pytest.approx(sum(expected) / len(expected))
        assert (
            s.stats["read_positions_peak"] == 16
            and s.stats["held_positions_mean"] == stats["held_positions_mean"]
        )
    dense = engine(None).generate(random_prompts([10], 0), n=1, max_new_tokens=30).stats
    assert dense["read_positions_mean"] == dense["held_positions_mean"] == stats["held_positions_mean"]
    assert dense["read_positions_peak"] == 39


def test_memory_is_the_dense_engines():
    """Every position is kept: with prompts copied into each row, the dense engine's bytes; a group's prompt
    held once (its whole pages) holds less."""
    kv = KVConfig(method="block_topk", budget=16, page_size=4, dense_layers=[0])
    prompts = random_prompts([10, 3], 0)
    sparse = engine(kv, share_prompts=False).generate(prompts, n=2, max_new_tokens=20).stats
    dense = engine(None, share_prompts=False).generate(prompts, n=2, max_new_tokens=20).stats
    assert sparse["peak_kv_bytes"] == dense["peak_kv_bytes"] and sparse["retained_fraction"] == 1.0
    shared = engine(kv).generate(prompts, n=2, max_new_tokens=20).stats
    assert shared["peak_kv_bytes"] < sparse["peak_kv_bytes"] and shared["retained_fraction"] == 1.0


# --- seam and bad input ---------------------------------------------------------------------------------------


def test_a_registered_selector_is_a_kv_method():
    """Registering a page selector is all a new block-sparse method needs: kv.method accepts it and the engine
    reads pages with it."""

    @SELECTORS.register("first_key")
    class FirstKey(BlockTopK):
        """Summarise a page by its first key."""

        def summarise(self, page_keys: torch.Tensor) -> torch.Tensor:
            return page_keys[..., :1, :].float()

    try:
        kv = KVConfig(method="first_key", budget=48, page_size=16)
        assert kv.sparse_attention and not kv.evicting
        assert isinstance(make_sparse_attention(kv, num_layers=2).selector, FirstKey)
    finally:
        del SELECTORS["first_key"]
    assert SELECTORS["block_topk"] is BlockTopK


def test_block_topk_reads_pages_without_evicting():
    kv = KVConfig(method="block_topk", budget=64)
    assert kv.sparse and kv.sparse_attention and not kv.evicting


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"budget": 40}, r"kv.budget=40 is not a multiple of kv.page_size=16"),
        ({"budget": 32}, r"kv.budget=32 is below the always-read pages.*3 x kv.page_size=16 = 48"),
        ({"budget": 12, "page_size": 8}, r"kv.budget=12 is not a multiple of kv.page_size=8"),
        ({"page_size": 0}, r"kv.page_size=0 must be >= 1"),
        ({"dense_layers": [0, -1]}, r"kv.dense_layers=\[0, -1\]"),
        ({"schedule": [[0, 48], [100, 40]]}, r"bin 1 \(from length 100\) has budget 40, below bin 0's 48"),
        (
            {"schedule": [[0, 48], [100, 56]]},
            r"kv.schedule bin 1 \(from length 100\): budget 56 is not a multiple",
        ),
        ({"schedule": [[0, 32], [100, 64]]}, r"kv.schedule bin 0 \(from length 0\): budget 32 is below"),
    ],
)
def test_bad_block_topk_settings_name_the_culprit(overrides, message):
    with pytest.raises(UserError, match=message):
        KVConfig(method="block_topk", **{"budget": 64, **overrides})


def test_dense_layers_beyond_the_model_are_an_error():
    with pytest.raises(
        UserError, match=r"kv.dense_layers=\[0, 3\] names layer 3, but the model has 3 layers"
    ):
        engine(KVConfig(method="block_topk", budget=64, dense_layers=[0, 3]))
