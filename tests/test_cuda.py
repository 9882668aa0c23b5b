"""The engine on a CUDA GPU (skipped without one; `pytest -m cuda`): the same checks as on CPU, on the module
path (no packed copy) and the packed bfloat16 path, eager and compiled, with forks and quantized caches."""

from __future__ import annotations

import pytest
import torch
from test_bf16 import BF16_TOL
from test_compile import COMPILE_TOL, cap_requests, same_samples
from test_engine import AGREE_TOL, max_gap, prompts_of, score_rollouts

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.decoding import Sampling
from sparserl.models import tiny_model
from sparserl.rollout import Scheduler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 tolerance is float32's, not TF32's


@pytest.fixture
def tiny_cuda(no_tf32):
    model, tok = tiny_model("llama", seed=0)
    return model.cuda(), tok


def no_eos_engine(tiny_cuda, kv: KVConfig | None = None, **kwargs) -> RolloutEngine:
    """An engine on the GPU model that draws every requested token (EOS ignored), as the CPU tests' engines."""
    model, tok = tiny_cuda
    e = RolloutEngine(model, tok, kv=kv, **kwargs)
    e.eos_ids = set()
    return e


def test_cuda_sampler_matches_the_scorer(tiny_cuda):
    model, tok = tiny_cuda
    prompts = prompts_of(tok)
    out = RolloutEngine(model, tok).generate(prompts, n=3, max_new_tokens=20, seed=0)
    assert max_gap(out, score_rollouts(model, prompts, out)) < AGREE_TOL


def test_cuda_bf16_rollouts_within_the_bf16_tolerance(tiny_cuda):
    model, tok = tiny_cuda
    prompts = prompts_of(tok)
    out = RolloutEngine(model, tok, dtype=torch.bfloat16).generate(prompts, n=3, max_new_tokens=20, seed=0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert max_gap(out, score_rollouts(model, prompts, out)) < BF16_TOL


def test_cuda_compiled_step_equals_the_eager_one(tiny_cuda):
    model, tok = tiny_cuda
    prompts = prompts_of(tok)
    eager = RolloutEngine(model, tok).generate(prompts, n=3, max_new_tokens=20, seed=0)
    compiled = RolloutEngine(model, tok, compile=True).generate(prompts, n=3, max_new_tokens=20, seed=0)
    assert same_samples(eager, compiled) < AGREE_TOL


def test_cuda_graphs_evicting_under_a_cap_give_the_eager_samples(tiny_cuda):
    """The compiled step on a GPU runs as a CUDA graph (mode reduce-overhead) writing the cache in place: R-KV
    under a memory cap (rows come and go, buckets change, the cut stays eager between replays) gives the eager
    samples, so no replay read a stale cache or a logits buffer the next replay had overwritten."""
    kv = KVConfig(method="rkv", budget=12, window=4, interval=4)
    lengths = [5, 40, 9, 17, 3, 60, 22, 8, 31]
    eager, graphs = no_eos_engine(tiny_cuda, kv), no_eos_engine(tiny_cuda, kv, compile=True)
    assert graphs.cuda_graphs
    static, _, _ = Scheduler(eager).run(cap_requests(lengths), Sampling())
    run, unfinished, _ = Scheduler(graphs, 6 * 15 * static.bytes_per_position).run(
        cap_requests(lengths), Sampling()
    )
    assert not unfinished and len(graphs.compiled_shapes) >= 2
    for i in range(len(lengths)):
        (a, la), (b, lb) = static.completion(i), run.completion(i)
        assert a == b
        torch.testing.assert_close(la.cpu(), lb.cpu(), atol=COMPILE_TOL, rtol=0)


ARMS = {  # the rollout systems whose GPU path differs from the default run's
    "default": [],
    "block_topk": [
        "kv.method=block_topk",
        "kv.budget=16",
        "kv.page_size=4",
        "kv.dense_layers=0",
    ],  # prompts held once
    "tree": ["rollout.tree.enable=true", "rollout.n=2", "rollout.tree.forks=1", "algo.adv_transforms=[tree]"],
    "kv_fp8": ["kv.quant=fp8"],  # the CPU reads fp8 codes as the GPU does (int8 takes int8 products there)
    "spec": ["rollout.spec.enable=true"],  # batched verification from step 2
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_cuda_training_follows_the_cpu_run(tmp_path, no_tf32, arm):
    """model.device=cuda trains on the GPU: step 1 samples the same tokens as the CPU run (the sampler's random
    numbers are device-independent; only log-prob rounding differs) and its loss agrees to float32 rounding."""
    from test_trainer import make_trainer, rows, tiny_cfg

    runs = {}
    for device in ("cpu", "cuda"):
        cfg = tiny_cfg(tmp_path, f"model.device={device}", "trainer.steps=2", *ARMS[arm], name=device)
        trainer = make_trainer(cfg)
        assert next(trainer.policy.module.parameters()).device.type == device
        trainer.train()
        runs[device] = {r["step"]: r for r in rows(tmp_path / device) if "reward/mean" in r}
    cpu, gpu = runs["cpu"][1], runs["cuda"][1]
    assert (cpu["reward/mean"], cpu["length/mean"]) == (gpu["reward/mean"], gpu["length/mean"])
    assert gpu["actor/loss"] == pytest.approx(cpu["actor/loss"], rel=1e-4, abs=1e-6)


def test_cuda_run_resumes_exactly_on_the_gpu_and_on_the_cpu(tmp_path, no_tf32):
    """A GPU run killed after step 2 resumes bitwise on the GPU, and its checkpoint also resumes on the CPU."""
    from test_trainer import make_trainer, tiny_cfg, weights

    lora = ["model.lora=true", "model.lora_r=4", "optim.lr=1e-2"]
    straight = make_trainer(tiny_cfg(tmp_path, *lora, "model.device=cuda", name="straight"))
    straight.train()
    for device in ("cuda", "cpu"):
        name = f"killed-{device}"
        make_trainer(tiny_cfg(tmp_path, *lora, "model.device=cuda", name=name)).train(until_step=2)
        resumed = make_trainer(tiny_cfg(tmp_path, *lora, f"model.device={device}", name=name),
                               run_dir=tmp_path / name, resume=True)  # fmt: skip
        assert resumed.state.step == 2
        resumed.train()
        if device == "cuda":
            a, b = weights(straight), weights(resumed)
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_cuda_block_sparse_prompt_held_once_equals_copies(tiny_cuda):
    """block_topk on the GPU: a group's prompt pages held once (read through the shared attention) give the
    samples of rows holding copies, within the CPU tolerance (tests/test_shared_prefix.py)."""
    from test_shared_prefix import assert_same_samples

    tok = tiny_cuda[1]
    kv = KVConfig(method="block_topk", budget=24, page_size=4, dense_layers=[0])
    out = {}
    for share in (True, False):
        out[share] = no_eos_engine(tiny_cuda, kv, share_prompts=share).generate(
            prompts_of(tok), n=4, max_new_tokens=32, seed=3
        )
    assert_same_samples(out[True], out[False])
    assert out[True].stats["read_positions_mean"] < out[True].stats["held_positions_mean"]


def calibration_unit(model, tok, tmp_path, device: str):
    """One calibration unit (block_topk, a prompt x 4 samples, exact alpha) on `device`, kept and read back."""
    from sparserl.eval.calibrate import CalibrationSettings, measure_unit
    from sparserl.eval.calibrate_store import UnitStore

    s = CalibrationSettings("block_topk", {"page_size": 4, "dense_layers": [0]}, n=4, max_new_tokens=24,
                            bin_width=16, tau=0.8, ignore_eos=True)  # fmt: skip
    alpha = measure_unit(model.to(device), tok, prompts_of(tok)[0], s.kv(budget=16), s)
    store = UnitStore(tmp_path / device, resume=False)
    store.save("16", 0, alpha, "digest", device)
    return store.load("16", 0, "digest")


def test_cuda_calibration_unit_matches_the_cpu_one(tiny_cuda, tmp_path):
    """`benchmarks/frontier.py --device cuda`'s units: the same tokens' alpha as on the CPU (float32 without
    TF32), within the sampler/scorer tolerance, and a unit measured on the GPU is stored and read back."""
    model, tok = tiny_cuda
    gpu = calibration_unit(model, tok, tmp_path, "cuda")
    cpu = calibration_unit(model, tok, tmp_path, "cpu")
    assert torch.equal(gpu.positions, cpu.positions) and gpu.exact.device.type == "cpu"
    # a sample may draw another token at a rounding boundary and go on from another prefix: the median
    # difference is robust to a few such tokens, the P5 (what a unit is for) to more
    assert (gpu.exact - cpu.exact).abs().median() < AGREE_TOL
    assert abs(float(gpu.exact.quantile(0.05)) - float(cpu.exact.quantile(0.05))) < 1e-3


@pytest.mark.parametrize("name", ["dense", "rkv", "block_topk", "rkv-int8"])
def test_cuda_forks_draw_the_parents_tokens_again(tiny_cuda, name):
    """Tree forks on the GPU (engine/forks.py): children started from their parents' kept states, on the
    parents' streams, draw the parents' tokens again with no prefill (tests/test_forks.py on the CPU)."""
    from test_forks import KVS, assert_forks_draw_the_parents_tokens, logp_tol

    e = no_eos_engine(tiny_cuda, KVS[name])
    assert_forks_draw_the_parents_tokens(e, name, group=2, tol=logp_tol(KVS[name]))


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_cuda_quantized_reads_equal_attention_over_the_dequantized_cache(no_tf32, quant):
    """kv.quant on the GPU reads codes in batched chunks (every row and head, float query): equal to attention
    over the dequantized cache, across the chunk and slab boundaries."""
    from test_kv_quant import assert_attention_over_the_dequantized_cache

    from sparserl.engine.kv_quant import CHUNK, SLAB

    for span in (5, CHUNK + 37, SLAB + 37):
        assert_attention_over_the_dequantized_cache(quant, span, "cuda")


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_cuda_quantized_cache_first_token_exact_and_later_ones_close(tiny_cuda, quant):
    """A quantized cache on the GPU: the prefill's token is the dense engine's bit for bit, later ones close."""
    from test_kv_quant import assert_first_token_exact_and_later_ones_close

    engines = [no_eos_engine(tiny_cuda, KVConfig(quant=q)) for q in ("none", quant)]
    assert_first_token_exact_and_later_ones_close(*engines)
