"""The quantized KV cache (kv.quant=int8|fp8): the round trip bounded by the scale, the chunked attention equal to
attention over the dequantized cache, the eviction bound and positions kept under every eviction method, block-
sparse reads over codes, the bytes counted quantized against the dense engine's own allocation, and exact
resume of a training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_conformance_eviction import StepChecker
from test_eviction import engine, random_prompts
from test_trainer import make_trainer, rows, tiny_cfg, weights

from sparserl.cli import main
from sparserl.cost import Rollout, estimate, load_shape
from sparserl.cost.model import kv_position_bytes
from sparserl.engine import EVICTION_METHODS, KVConfig
from sparserl.engine.decoder import decode_attention
from sparserl.engine.kv_quant import CHUNK, CODECS, SLAB, QuantizedKVCache
from sparserl.errors import UserError

QUANTS = sorted(CODECS)
ATTEND_TOL = 1e-5  # chunked attention over codes vs attention over the dequantized cache: ~1e-7 measured


def round_trip_bound(quant: str, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The documented bound per element: int8 half a step (scale / 2); fp8 e4m3 a relative 2^-4 of |x|, or
    half its subnormal step near zero (scale * 2^-10); plus float32 rounding of x / scale."""
    s = scale[..., None]
    eps = 1e-6 * x.abs() + 1e-12
    if quant == "int8":
        return s / 2 + eps
    return x.abs() / 16 + s * 2**-10 + eps


@pytest.mark.parametrize("quant", QUANTS)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), magnitude=st.floats(1e-4, 1e4), d=st.sampled_from([4, 64]))
def test_round_trip_error_is_bounded_by_the_scale(quant, seed, magnitude, d) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 5, d, generator=g) * magnitude
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 0, decoded exactly
    codec = CODECS[quant]
    data, scale = codec.encode(x)
    assert data.dtype == codec.storage and scale.shape == x.shape[:-1]
    back = codec.decode(data, scale, torch.float32)
    assert (back - x).abs().le(round_trip_bound(quant, x, scale)).all()
    assert torch.equal(back[0, 0, 0], torch.zeros(d))
    # the largest element of each vector is the top code: the scale is used to its full range
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=2**-4)


def filled_cache(
    quant: str, span: int, rows: int = 3, seed: int = 0, device: str = "cpu"
) -> tuple[QuantizedKVCache, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cache = QuantizedKVCache(1, rows, 2, 4, 8, span, 4, torch.float32, torch.device(device), quant=quant)
    k, v = torch.randn(rows, 2, span, 8, generator=g), torch.randn(rows, 2, span, 8, generator=g)
    lengths = torch.randint(1, span + 1, (rows,), generator=g)
    positions = torch.arange(span)[None].expand(rows, -1)
    cache.fill(0, k.to(device), v.to(device), positions.to(device), lengths.to(device))
    return cache, torch.randn(rows, 4, 1, 8, generator=g).to(device)


def read_query(quant: str, q: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    """The scaled query a cache's attention reads with: an int8 cache on the CPU quantizes it as it does keys
    (int8 dot products), any other as given."""
    n, hq, _, d = q.shape
    grouped = q.view(n, kv_heads, hq // kv_heads, d) * scale
    if quant == "int8" and q.device.type == "cpu":
        codes, s = CODECS["int8"].encode(grouped)
        grouped = codes.float() * s[..., None]
    return grouped.view(n, hq, 1, d)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("span", [5, CHUNK + 37, SLAB + 37])
def test_chunked_attention_equals_attention_over_the_dequantized_cache(quant, span) -> None:
    assert_attention_over_the_dequantized_cache(quant, span, "cpu")


def assert_attention_over_the_dequantized_cache(quant: str, span: int, device: str) -> None:
    """The test above on `device` (tests/test_cuda.py runs it on a GPU, where every read is batched)."""
    cache, q = filled_cache(quant, span, device=device)
    valid = cache.valid(span)
    out, probs = cache.attend(0, q, valid, span, 0.3)
    k, v = cache.view(0, span)
    ref_out, ref_probs = decode_attention(read_query(quant, q, 2, 0.3), k, v, valid, 1.0)
    assert (out - ref_out).abs().max() < ATTEND_TOL
    assert (probs - ref_probs).abs().max() < ATTEND_TOL


@pytest.mark.parametrize("quant", QUANTS)
def test_the_batched_reads_off_the_cpu_equal_products_with_the_dequantized_cache(quant) -> None:
    """The path a GPU takes (every row and head together, CHUNK slots at a time), run here on the CPU."""
    span = CHUNK + 37
    cache, q = filled_cache(quant, span)
    k, v = cache.view(0, span)
    x = q.view(3, 2, 2, 8)
    scores = cache._chunked_scores(x, cache.k[0], span) * cache.k_scale[0][:, :, None, :span]
    assert (scores - x @ k.transpose(-1, -2)).abs().max() < ATTEND_TOL
    w = torch.rand(3, 2, 2, span, generator=torch.Generator().manual_seed(1))
    values = cache._chunked_values(w * cache.v_scale[0][:, :, None, :span], cache.v[0], span)
    assert (values - w @ v).abs().max() < 10 * ATTEND_TOL  # a sum of 549 weighted values


def test_the_int8_querys_rounding_moves_a_score_by_at_most_half_its_step_times_the_keys_l1_norm() -> None:
    """|q . k - q_int8 . k| <= (scale_q / 2) sum_d |k_d|: what the int8 dot products add to the cache's own
    rounding (measured in the scores the softmax reads)."""
    cache, q = filled_cache("int8", 300, seed=4)
    k, _ = cache.view(0, 300)
    grouped = q.view(3, 2, 2, 8) * 0.3
    _, q_scale = CODECS["int8"].encode(grouped)
    exact = grouped @ k.transpose(-1, -2)
    moved = (cache._int8_scores(0, grouped, 300) * cache.k_scale[0][:, :, None, :300] - exact).abs()
    bound = q_scale[..., None] / 2 * k.abs().sum(-1)[:, :, None, :] + 1e-5
    assert moved.max() > 0 and (moved <= bound).all()


@pytest.mark.parametrize("quant", QUANTS)
def test_gathered_slots_and_kept_slots_carry_their_scales(quant) -> None:
    cache, _ = filled_cache(quant, 12)
    k, v = cache.view(0, 12)
    slots = torch.tensor([[[0, 3, 7], [1, 2, 11]]]).expand(3, -1, -1)
    gk, gv = cache.gather(0, slots)
    assert torch.equal(gk, k.gather(2, slots[..., None].expand(-1, -1, -1, 8)))
    assert torch.equal(gv, v.gather(2, slots[..., None].expand(-1, -1, -1, 8)))
    assert torch.equal(cache.slot_keys(0, torch.tensor([1]), torch.tensor([[2, 5]])), k[1:2, :, [2, 5]])
    cache.keep_slots(slice(None), [slots])
    kept_k, kept_v = cache.view(0, 3)
    assert torch.equal(kept_k, gk) and torch.equal(kept_v, gv)


def test_an_unknown_quant_names_the_key() -> None:
    with pytest.raises(UserError, match=r"kv.quant='int4'.*none, int8, fp8"):
        KVConfig(quant="int4")
    assert KVConfig(quant="int8").sparse and not KVConfig().sparse


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("method", sorted(EVICTION_METHODS))
def test_eviction_bound_and_positions_hold_on_a_quantized_cache(method, quant) -> None:
    kv = KVConfig(method=method, budget=14, window=3, interval=3, quant=quant)
    e = engine(kv)
    check = StepChecker(kv, [9, 20], 2, 17)
    e.step_hooks.append(check)
    out = e.generate(random_prompts([9, 20], 1), n=2, max_new_tokens=17, seed=3)
    assert check.steps == 16 and out.stats["peak_kv_positions"] <= kv.budget + kv.interval - 1


def kv_bytes(kv: KVConfig, share_prompts: bool = True) -> dict[str, float]:
    out = engine(kv, share_prompts=share_prompts).generate(
        random_prompts([30, 12], 2), n=2, max_new_tokens=24, seed=0
    )
    return out.stats


@pytest.mark.parametrize("quant", QUANTS)
def test_bytes_are_counted_quantized_against_the_dense_engines_allocation(quant) -> None:
    dense, rkv = KVConfig(), KVConfig(method="rkv", budget=16, interval=4)
    full, full_rkv = kv_bytes(dense), kv_bytes(rkv, share_prompts=False)  # a quantized cache copies prompts
    q = kv_bytes(KVConfig(quant=quant))
    q_rkv = kv_bytes(KVConfig(method="rkv", budget=16, interval=4, quant=quant))
    # tiny llama: head_dim 16, so a position's codes and scale are (16 + 4) / (16 x 4) of float32's bytes
    per = q["kv_bytes_per_position"] / full["kv_bytes_per_position"]
    assert per == pytest.approx(20 / 64)
    assert q["peak_dense_kv_bytes"] == full["peak_dense_kv_bytes"] == full["peak_kv_bytes"]
    assert q_rkv["peak_kv_bytes"] == pytest.approx(full_rkv["peak_kv_bytes"] * per)
    assert q_rkv["peak_dense_kv_bytes"] == full["peak_kv_bytes"]


@pytest.mark.parametrize("quant", QUANTS)
def test_block_sparse_reads_over_a_quantized_cache(quant) -> None:
    """block_topk reads whole pages of codes: the run is the quantized dense run while the budget covers every
    page, and reads at most the budget after."""
    prompts = random_prompts([20, 9], 4)
    covering = engine(KVConfig(method="block_topk", budget=96, page_size=8, quant=quant))
    dense = engine(KVConfig(quant=quant))
    a = covering.generate(prompts, n=2, max_new_tokens=20, seed=5)
    b = dense.generate(prompts, n=2, max_new_tokens=20, seed=5)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    for x, y in zip(a, b, strict=True):
        assert (x.logprobs - y.logprobs).abs().max() < ATTEND_TOL
    tight = engine(KVConfig(method="block_topk", budget=32, page_size=8, quant=quant))
    out = tight.generate(prompts, n=2, max_new_tokens=30, seed=5)
    assert out.stats["read_positions_peak"] <= 32


@pytest.mark.parametrize("method", [*sorted(EVICTION_METHODS), "block_topk"])
def test_the_prompts_cut_and_page_summaries_are_made_at_full_precision(method) -> None:
    """An evicting method cuts a long prompt, and block_topk summarises its pages, on the prefill's own keys
    before they are quantized: at the first decode step the int8 run holds the float32 run's positions and page
    summaries, bit for bit."""

    def first_step(quant: str) -> dict[str, torch.Tensor]:
        seen: dict[str, torch.Tensor] = {}

        def hook(step: int, cache, samples: torch.Tensor) -> None:
            if step == 0:  # no page fills and no cut at step 0 (prompts of 20 and 30, pages of 8, interval 4)
                seen.update({f"pos.{i}": p.clone() for i, p in enumerate(cache.pos)})
                seen.update(
                    {k: v.clone() for k, v in cache.row_state.items() if k.startswith("page_summaries")}
                )

        budget = 32 if method == "block_topk" else 16  # block_topk always reads 3 pages of 8
        kv = KVConfig(method=method, budget=budget, interval=4, page_size=8, dense_layers=[], quant=quant)
        e = engine(kv, share_prompts=False)  # a quantized cache copies prompts: compared with copies
        e.step_hooks.append(hook)
        e.generate(random_prompts([20, 30], 7), n=2, max_new_tokens=3, seed=1)
        return seen

    full, int8 = first_step("none"), first_step("int8")
    assert full.keys() == int8.keys() and any(k.startswith("page_summaries") for k in full) == (
        method == "block_topk"
    )
    assert all(torch.equal(full[k], int8[k]) for k in full)


@pytest.mark.parametrize("quant", QUANTS)
def test_the_first_token_is_exact_and_later_ones_close(quant) -> None:
    """Prefill is full precision (the first token's log-prob is the dense engine's bit for bit); decode steps
    read quantized keys and values (log-probs of the same tokens within 0.2 nats on the random tiny model)."""
    assert_first_token_exact_and_later_ones_close(engine(KVConfig()), engine(KVConfig(quant=quant)))


def assert_first_token_exact_and_later_ones_close(dense, quantized) -> None:
    """The test above on two engines of one model (tests/test_cuda.py runs it on a GPU)."""
    prompts = random_prompts([20, 30], 6)
    a = dense.generate(prompts, n=1, max_new_tokens=6, seed=2)
    b = quantized.generate(prompts, n=1, max_new_tokens=6, seed=2)
    for x, y in zip(a, b, strict=True):
        assert x.logprobs[0] == y.logprobs[0]
        same = next(
            (i for i, (s, t) in enumerate(zip(x.completion_ids, y.completion_ids, strict=True)) if s != t), 6
        )
        assert (x.logprobs[:same] - y.logprobs[:same]).abs().max() < 0.2


def test_a_quantized_run_resumes_exactly(tmp_path: Path) -> None:
    extra = ["kv.quant=int8", "trainer.steps=3"]
    straight = make_trainer(tiny_cfg(tmp_path, *extra, name="straight"))
    straight.train()
    first = make_trainer(tiny_cfg(tmp_path, *extra, name="killed"))
    first.train(until_step=2)
    del first
    resumed = make_trainer(
        tiny_cfg(tmp_path, *extra, name="killed"), run_dir=tmp_path / "killed", resume=True
    )
    resumed.train()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = {r["step"]: r for r in rows(tmp_path / "straight") if "reward/mean" in r}
    rb = {r["step"]: r for r in rows(tmp_path / "killed") if "reward/mean" in r}
    for key in ("reward/mean", "actor/loss", "rollout_corr/kl", "kv/saved_fraction"):
        assert ra[3][key] == rb[3][key], key


@pytest.mark.parametrize("quant", QUANTS)
def test_the_cost_model_counts_the_engines_quantized_bytes(quant) -> None:
    """`sparserl cost --kv-quant` charges a position what the engine's quantized cache allocates, and a sample
    the engine's measured peak (R-KV on the tiny model, one sample: nothing held once)."""
    shape = load_shape("tiny-llama")
    kv = KVConfig(method="rkv", budget=16, interval=4, quant=quant)
    out = engine(kv).generate(random_prompts([10], 0), n=1, max_new_tokens=40, seed=0)
    assert kv_position_bytes(shape, kv) == out.stats["kv_bytes_per_position"]
    predicted = estimate(shape, Rollout(10, 40, 1), kv)
    assert predicted.bytes_per_sequence == out.stats["peak_kv_bytes"]
    assert predicted.method == f"rkv+{quant}"
    full = estimate(shape, Rollout(10, 40, 1), KVConfig(method="rkv", budget=16, interval=4))
    assert predicted.decode.kv_read_bytes < full.decode.kv_read_bytes
    assert predicted.decode.overhead_flops > full.decode.overhead_flops  # the codes' conversion


def test_cost_rows_under_kv_quant(capsys) -> None:
    assert (
        main(
            [
                "cost",
                "--model",
                "tiny-llama",
                "--methods",
                "rkv",
                "--kv-quant",
                "int8",
                "--output-len",
                "256",
                "--json",
            ]
        )
        == 0
    )
    rows = [r["method"] for r in json.loads(capsys.readouterr().out)["methods"]]
    assert rows == ["dense", "dense+int8", "rkv+int8"]


def test_distill_refuses_a_quantized_cache(tmp_path: Path) -> None:
    from sparserl.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kv.quant='int8' is not implemented"):
        tiny_cfg(tmp_path, "kv.method=block_topk", "kv.budget=64", "kv.quant=int8", "algo.preset=tis",
                 "distill.enable=true", "model.lora=true")  # fmt: skip


def test_a_kv_memory_cap_counts_the_quantized_bytes() -> None:
    """Under one cap, a quantized cache holds more sequences at once than a float32 one (each position costs
    ~0.31x here), so the same requests take fewer decode steps, and it never holds more bytes than the cap."""
    from sparserl.engine.decoding import Request, Sampling
    from sparserl.rollout.scheduler import Scheduler

    prompts = random_prompts([20, 9, 14], 8)
    requests = [Request(prompts[i % 3], key=i, seed=3, max_new_tokens=30) for i in range(12)]
    full, quant = engine(KVConfig()), engine(KVConfig(quant="int8"))
    cap = 3 * 64 * full.decoder.num_layers * 2 * full.decoder.num_kv_heads * full.decoder.head_dim * 4
    steps = {}
    for name, e in (("float32", full), ("int8", quant)):
        run, unfinished, stats = Scheduler(e, cap).run(requests, Sampling())
        assert not unfinished and run.peak_bytes <= cap
        steps[name] = stats.decode_steps
    assert steps["int8"] < 0.8 * steps["float32"], steps


def test_fp8_codes_read_through_the_table_are_torchs_float8_values() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(16, 16)
    codes = codes[
        (codes.view(torch.float8_e4m3fn).float().isnan()).logical_not()
    ]  # the encoder writes no NaN
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(CODECS["fp8"].codes(codes, torch.float32), want)
    strided = torch.randint(0, 120, (2, 3, 10, 4), dtype=torch.uint8)[:, :, 2:7]  # a chunk of a cache: a view
    assert torch.equal(CODECS["fp8"].codes(strided, torch.float32), strided.view(torch.float8_e4m3fn).float())
