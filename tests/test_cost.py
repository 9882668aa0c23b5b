"""The cost model (`sparserl cost`): FLOP and byte counts on hand-computed cases, agreement with Sparrow's closed
form, the engine's own schedule of held positions, memory fits, the probe, and bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl.cli import main
from sparserl.cost import Cost, CostInputError, ModelShape, Rollout, estimate, load_shape, probe_intensity
from sparserl.cost.model import cost_model
from sparserl.cost.probe import INTENSITY_PRESETS, resolve_intensity
from sparserl.cost.report import implied_intensity, parse_size
from sparserl.cost.shape import shape_from_config
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.errors import UserError
from sparserl.models import ModelLoadError, tiny_model

# layers 2, hidden 8, 2 query heads sharing 1 KV head of dim 4, vocab 10, MLP 16, float32.
# Per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + MLP 3x8x16 = 576 weights; per token 2 x 576 + LM head 10 x 8 = 1232.
# One position: K + V, 2 layers x 1 head x 4 dims x 4 bytes x 2 = 64 bytes.
TINY = ModelShape("hand", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, vocab=10, intermediate=16,
                  tied_embeddings=True, dtype_bytes=4)  # fmt: skip

SMOLLM2 = SimpleNamespace(
    num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    vocab_size=49152, intermediate_size=1536, tie_word_embeddings=True,
)  # fmt: skip


def test_shape_counts_by_hand():
    assert TINY.layer_params == 576
    assert TINY.token_params == 1232
    assert TINY.total_params == 1232  # tied: the embedding is the LM head
    assert replace(TINY, tied_embeddings=False).total_params == 1232 + 80
    assert TINY.kv_bytes_per_position == 64
    smollm2 = shape_from_config(SMOLLM2, "smollm2")
    assert smollm2.token_params == 134_479_872  # SmolLM2-135M
    assert smollm2.kv_bytes_per_position == 46080  # the engine's kv_bytes_per_position, float32


def test_dense_rollout_by_hand():
    """Prompt 3, 3 new tokens, 2 samples: the prefill yields token 1, then 2 decode steps at contexts 4 and 5."""
    est = estimate(TINY, Rollout(prompt_len=3, output_len=3, n=2), KVConfig())
    d = est.decode
    assert d.weight_flops == 2 * 1232 * 2 * 2  # 2 x weights x samples x steps = 9856
    assert d.attention_flops == 4 * 2 * 4 * (2 * (4 + 5)) * 2  # 4 x heads x dim x layer-positions x samples
    assert d.weight_bytes == (1232 + 2 * 8) * 4 * 2  # weights once per step + 2 embedding rows = 9984
    assert d.kv_read_bytes == 2 * 1 * 4 * 4 * 18 * 2  # K+V of 18 layer-positions x 2 samples = 1152
    assert d.kv_write_bytes == 64 * 2 * 2  # one position per sample per step = 256
    assert d.overhead_flops == d.overhead_bytes == 0
    p = est.prefill
    assert p.weight_flops == 2 * 2 * 576 * 3 + 2 * 10 * 8  # layers for 3 tokens, LM head for the last = 7072
    assert p.attention_flops == 4 * 2 * 4 * 2 * (1 + 2 + 3)  # causal = 384
    assert p.weight_bytes == 1232 * 4 + 3 * 8 * 4
    assert p.kv_read_bytes == (3 + 3) * 64 and p.kv_write_bytes == (3 + 2 * 3) * 64  # + copy to 2 samples
    assert est.positions_held == 6 and est.bytes_per_sequence == 6 * 64
    assert est.mean_positions_read == 4.5


def test_eviction_by_hand():
    """Budget 4, a cut before every 2nd step: prompt 5 is cut to 4 after prefill, then held goes 5, (cut to 3)
    4, 5, (3) 4, 5, (3) 4, 5 over the 7 decode steps."""
    kv = KVConfig(method="h2o", budget=4, interval=2, window=1)
    est = estimate(TINY, Rollout(prompt_len=5, output_len=8, n=1), kv)
    held = [5, 4, 5, 4, 5, 4, 5]
    assert est.decode.attention_flops == 4 * 2 * 4 * 2 * sum(held)
    assert est.decode.kv_read_bytes == 32 * 2 * sum(held)
    assert est.decode.overhead_bytes == 3 * 2 * 3 * 64  # 3 cuts, each copying 3 kept positions (read + write)
    assert est.prefill.overhead_bytes == 2 * 4 * 64  # the post-prefill cut keeps 4
    assert est.prefill.kv_write_bytes == (5 + 4) * 64  # the prompt, then 4 kept positions to the one sample
    assert est.positions_held == 4 + 2 - 1  # budget + interval - 1


def test_block_sparse_by_hand():
    """Page 2, budget 6 (3 pages), layer 0 dense: prompt 7, decode contexts 8, 9, 10 read 8|6, 9|6, 10|6
    positions (dense|sparse layer); each scores every page (4, 5, 5) and gathers 6 positions; pages fill at
    8 and 10."""
    kv = KVConfig(method="block_topk", budget=6, page_size=2, dense_layers=[0])
    est = estimate(TINY, Rollout(prompt_len=7, output_len=4, n=1), kv)
    assert est.decode.attention_flops == 4 * 2 * 4 * (14 + 15 + 16)
    head_slice = 1 * 1 * 4  # sparse layers x KV heads x head dim
    scoring = [head_slice * (2 + 2 * pages) for pages in (4, 5, 5)]  # query mean (group 2) + 2 per page
    filled = 2 * head_slice * 2  # page size x head slice, at contexts 8 and 10
    assert est.decode.overhead_flops == sum(scoring) + filled == 152
    centroid_reads = sum(head_slice * pages * 4 for pages in (4, 5, 5))  # float32 centroids
    gathers = 3 * 2 * 6 * (2 * 4 * 4)  # 3 steps, read + write, 6 positions, K + V of one head
    centroid_writes = 2 * head_slice * (2 * 4 + 4)  # read the page's keys, write a float32 mean
    assert est.decode.overhead_bytes == centroid_reads + gathers + centroid_writes == 1472
    assert (est.prefill.overhead_flops, est.prefill.overhead_bytes) == (24, 144)  # 3 full prompt pages
    assert est.mean_positions_read == 45 / 6
    assert est.bytes_per_sequence == 11 * 64 + 6 * head_slice * 4  # whole cache + 6 pages' centroids


def spec_closed_form(shape: ModelShape, prompt: int, output: int, n: int) -> tuple[int, int]:
    """Sparrow's dense decode (spec section 4): C_comp and C_mem, D = K+V elements per position, 2-byte KV."""
    p, r, d = shape.token_params, shape.group, shape.kv_dim
    comp = 2 * p * n * output + r * (2 * prompt + output) * output * n * d
    mem = 2 * prompt * output * d + n * output**2 * d
    return comp, mem


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.integers(1, 3000),
    output=st.integers(2, 3000),
    n=st.integers(1, 16),
    layers=st.integers(1, 8),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 3, 4]),
)
def test_dense_matches_spec_closed_form(prompt, output, n, layers, kv_heads, group):
    """The spec sums L_out forwards at the mean context L_in + L_out / 2; the engine's first forward is the
    prefill's last position, so its exact decode sum is the closed form minus one forward at that mean context:
    2 P N + r D N (2 L_in + L_out) FLOPs, D (2 L_in + L_out) bytes. The spec's prompt term 2 L_in L_out D reads
    the prompt once for all N samples; the engine copies it to each, so the bytes are compared at N = 1."""
    shape = ModelShape("g", layers, 64, kv_heads * group, kv_heads, 16, 100, 128, True, dtype_bytes=2)
    d = estimate(shape, Rollout(prompt, output, n), KVConfig()).decode
    comp, _ = spec_closed_form(shape, prompt, output, n)
    r, dim, p = shape.group, shape.kv_dim, shape.token_params
    assert d.weight_flops + d.attention_flops == comp - (2 * p * n + r * dim * n * (2 * prompt + output))
    _, mem = spec_closed_form(shape, prompt, output, 1)
    single = estimate(shape, Rollout(prompt, output, 1), KVConfig()).decode
    assert single.kv_read_bytes == mem - dim * (2 * prompt + output)
    assert d.kv_read_bytes == n * single.kv_read_bytes


@pytest.mark.parametrize("method", ["rkv", "streaming_llm", "block_topk"])
def test_covering_budget_costs_dense(method):
    """A budget covering prompt + output: eviction never cuts and costs exactly dense; block_topk reads
    everything and only keeps its centroids up to date."""
    shape, rollout = shape_from_config(SMOLLM2, "smollm2"), Rollout(100, 300, 4)
    dense = estimate(shape, rollout, KVConfig())
    sparse = estimate(shape, rollout, KVConfig(method=method, budget=400))
    assert sparse.decode.attention_flops == dense.decode.attention_flops
    assert sparse.decode.kv_read_bytes == dense.decode.kv_read_bytes
    assert sparse.positions_held == dense.positions_held == 400
    assert sparse.mean_positions_read == dense.mean_positions_read
    if method == "block_topk":
        fills = sum(1 for c in rollout.contexts if c % 16 == 0)
        assert sparse.decode.overhead_flops == 4 * fills * 28 * 3 * 64 * 16  # no scoring, only page means
    else:
        assert sparse.decode == dense.decode and sparse.prefill == dense.prefill


def test_schedule_and_fixed_budget_agree():
    shape, rollout = TINY, Rollout(20, 200, 2)
    for method in ("rkv", "block_topk"):
        knobs = {"method": method, "window": 4, "dense_layers": []}
        fixed = estimate(shape, rollout, KVConfig(budget=48, **knobs))
        table = estimate(shape, rollout, KVConfig(schedule=[[0, 48]], **knobs))
        assert fixed.decode == table.decode
        grown = estimate(shape, rollout, KVConfig(schedule=[[0, 48], [100, 96]], **knobs))
        assert grown.decode.attention_flops > fixed.decode.attention_flops
        assert grown.budget == "48@0,96@100"


@pytest.mark.parametrize(
    "kv",
    [
        KVConfig(),
        KVConfig(method="snapkv", budget=12, interval=3, window=2),
        KVConfig(method="h2o", schedule=[[0, 10], [24, 16]], interval=4, window=2),
    ],
    ids=["dense", "snapkv", "h2o-schedule"],
)
def test_held_positions_follow_the_engine(kv):
    """The model's positions held at every decode step are the engine's `cache.held()` after that step (its
    own slots, and the group's prompt a dense row reads held once)."""
    model, tok = tiny_model("llama")
    engine = RolloutEngine(model, tok, kv=kv)
    engine.eos_ids = set()
    seen: list[list[int]] = []
    engine.step_hooks.append(lambda step, cache, alive: seen.append(cache.held().tolist()))
    prompt, output, n = 14, 30, 2
    engine.generate([list(range(5, 5 + prompt))], n=n, max_new_tokens=output)
    method = cost_model(kv)(load_shape("tiny-llama"), Rollout(prompt, output, n), kv)
    assert [[held] * n for held, *_ in method.decode()] == seen


def test_memory_cap_counts_match_the_sparse_benchmark():
    """docs/results/sparse_rollout.json: a 4 GiB KV cap fits 86 dense samples of 52 + 1024 positions, 22 of
    52 + 4096, and 145 evicting ones (budget 512 + interval 128 - 1 = 639 positions), SmolLM2 in float32."""
    shape, cap = shape_from_config(SMOLLM2, "smollm2"), parse_size("4GiB")
    assert estimate(shape, Rollout(52, 1024, 16), KVConfig()).sequences_fitting(cap) == 86
    assert estimate(shape, Rollout(52, 4096, 16), KVConfig()).sequences_fitting(cap) == 22
    evicting = estimate(shape, Rollout(52, 4096, 16), KVConfig(method="rkv", budget=512, interval=128))
    assert evicting.positions_held == 639 and evicting.sequences_fitting(cap) == 145
    block = estimate(shape, Rollout(52, 4096, 16), KVConfig(method="block_topk", budget=512))
    assert block.positions_held == 52 + 4096 and block.sequences_fitting(cap) == 21  # + centroids


def test_parse_size_units():
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("4g") == 4 * 2**30
    assert parse_size("1.5KiB") == 1536
    assert parse_size("1000") == 1000
    for bad in ("", "4 parsecs", "-1GiB", "0", "GiB"):
        with pytest.raises(CostInputError, match="--mem-cap"):
            parse_size(bad)


def test_probe_measures_positive_rates():
    probe = probe_intensity(load_shape("tiny-llama"), batch=4, threads=1, buffer_mib=8, repeats=3)
    assert probe.matmul_flops_per_s > 0 and probe.read_bytes_per_s > 0 and probe.copy_bytes_per_s > 0
    assert probe.intensity > 0 and (probe.threads, probe.batch, probe.dtype) == (1, 4, "float32")
    assert torch.get_num_threads() == 1  # restored


def test_intensity_presets_and_numbers():
    assert resolve_intensity("h200") == pytest.approx(989 / 4.8)
    assert resolve_intensity("2.5") == 2.5
    assert set(INTENSITY_PRESETS) >= {"cpu-1t", "cpu-2t", "h100", "h200"}
    for bad in ("fast", "0", "-3", "nan"):
        with pytest.raises(CostInputError, match="--intensity"):
            resolve_intensity(bad)


@pytest.fixture
def model_dir(tmp_path):
    """A model folder with only a config.json, as the cost model needs nothing else."""
    model, _ = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_cli_json_report(model_dir, capsys):
    code = main(["cost", "--model", model_dir, "--prompt-len", "32", "--output-len", "400", "--n", "4",
                 "--budget", "64", "--interval", "16", "--methods", "rkv,block_topk", "--dense-layers", "0", "--json"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [m["method"] for m in report["methods"]] == ["dense", "rkv", "block_topk"]
    dense, rkv, block = report["methods"]
    assert dense["speedup_vs_dense"] == 1.0 and rkv["speedup_vs_dense"] > 1.0
    assert rkv["positions_held"] == 64 + 16 - 1 and block["positions_held"] == 432
    assert rkv["sequences_at_mem_cap"] > dense["sequences_at_mem_cap"] > block["sequences_at_mem_cap"]
    assert report["intensity"] == INTENSITY_PRESETS["cpu-1t"]


def test_cli_table(model_dir, capsys):
    assert main(["cost", "--model", model_dir, "--output-len", "300", "--budget", "64"]) == 0
    out = capsys.readouterr().out
    assert "speed-up" in out and "seqs at cap" in out
    assert [line.split()[0] for line in out.splitlines()[-3:]] == ["dense", "rkv", "block_topk"]


def test_cli_decode_check(capsys):
    """--probe-decode times the engine per method and length and sets the ratios beside the model's."""
    code = main(["cost", "--model", "tiny-llama", "--probe-decode", "8,200", "--decode-steps", "4", "--repeats",
                 "2", "--n", "2", "--methods", "h2o,block_topk", "--budget", "48", "--interval", "2",
                 "--dense-layers", "0", "--json"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert code == 0
    assert [(r["method"], r["prompt_len"]) for r in rows] == [
        (method, length) for method in ("dense", "h2o", "block_topk") for length in (8, 200)
    ]
    assert rows[0]["measured_cpu_ratio"] == rows[0]["predicted_ratio"] == 1.0
    assert rows[1]["predicted_ratio"] > 1.0 and len(rows[1]["cpu"]) == len(rows[1]["wall"]) == 2
    assert all(t > 0 for r in rows for t in r["wall"])
    long_h2o = rows[3]
    assert long_h2o["predicted_speedup_vs_dense"] > 1.0  # 200 positions cut to 48
    # each timing also records the positions its generation read and held
    dense_200, topk_200 = rows[1]["positions"][0], rows[5]["positions"][0]
    assert dense_200["read_positions_mean"] == dense_200["held_positions_mean"] > 200
    assert topk_200["read_positions_mean"] <= 48 < topk_200["held_positions_mean"]
    assert long_h2o["positions"][0]["held_positions_mean"] < 48 + 2


@pytest.mark.parametrize(
    ("flags", "culprit"),
    [
        (["--prompt-len", "-5"], "prompt_len=-5"),
        (["--output-len", "0"], "output_len=0"),
        (["--methods", "dense,block_topk", "--budget", "100"], "kv.page_size=16"),
        (["--methods", "block_topk", "--budget", "32"], "always-read pages"),
        (["--methods", "block_topk", "--dense-layers", "0,7"], "layer 7"),
        (["--methods", "rkv", "--schedule", "[[0, 512], [2000, 256]]"], "non-decreasing"),
        (["--schedule", "no/such/schedule.json"], "does not exist"),
        (["--methods", "quantum"], "kv.method='quantum'"),
        (["--mem-cap", "lots"], "--mem-cap"),
        (["--intensity", "fast"], "--intensity"),
        (["--dtype", "int3"], "--dtype"),
    ],
)
def test_cli_bad_input_is_one_line(model_dir, capsys, flags, culprit):
    assert main(["cost", "--model", model_dir, *flags]) != 0
    err = capsys.readouterr().err.strip()
    assert culprit in err and len(err.splitlines()) == 1


def test_unknown_model_is_named(capsys):
    assert main(["cost", "--model", "no-such-model-anywhere"]) != 0
    assert "no-such-model-anywhere" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_shape("./missing/model")
    with pytest.raises(UserError, match="3 attention heads do not split into 2 KV heads"):
        ModelShape("odd", 2, 8, heads=3, kv_heads=2, head_dim=4, vocab=10, intermediate=16,
                   tied_embeddings=True, dtype_bytes=4)  # fmt: skip


def test_implied_intensity_by_hand():
    """(20 + I x 6) / (10 + I x 2) = 2.5 at I = 5; a ratio no positive I reaches gives None."""
    assert (
        implied_intensity(Cost(weight_flops=10, weight_bytes=2), Cost(weight_flops=20, weight_bytes=6), 2.5)
        == 5
    )
    assert (
        implied_intensity(Cost(weight_flops=10, weight_bytes=2), Cost(weight_flops=20, weight_bytes=6), 1.5)
        is None
    )
