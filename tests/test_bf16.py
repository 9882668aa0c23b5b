"""bfloat16 end to end: rollouts and their KV cache in bfloat16, scoring and the update under autocast over
float32 master weights (full fine-tuning) or a bfloat16 frozen base (LoRA).

The sampler/scorer gap in bfloat16 is not rounding noise but a real mismatch (the two sides round differently):
measured max |log p_sampler - log p_scorer| per token 0.14 on the tiny model (30 tokens x 12 samples) and 0.22
on SmolLM2-135M (48 tokens x 8 samples; mean 0.036, p99 0.18), against 1.7e-5 in float32. BF16_TOL = 0.5 per
token and BF16_MEAN_TOL = 0.1 leave ~2-3x room; scoring at a wrong temperature misses both (checked).
"""

from __future__ import annotations

from pathlib import Path

import torch
from test_engine import max_gap, no_eos, prompts_of, score_rollouts
from test_trainer import make_trainer, rows, tiny_cfg

from sparserl.engine import RolloutEngine
from sparserl.models import tiny_model
from sparserl.trainer.policy import Policy

BF16_TOL = 0.5  # max per-token sampler/scorer gap in bfloat16 (see module docstring)
BF16_MEAN_TOL = 0.1  # mean per-token gap


def mean_gap(rollouts, scored) -> float:
    return float(torch.cat([(s.logprobs - x).abs() for s, x in zip(rollouts, scored, strict=True)]).mean())


def test_bf16_rollouts_agree_with_the_autocast_scorer_within_the_documented_tolerance():
    model, tok = tiny_model("llama", seed=0)
    prompts = prompts_of(tok)
    dense = no_eos(RolloutEngine(model, tok)).generate(prompts, n=4, max_new_tokens=30, seed=0)
    half = no_eos(RolloutEngine(model, tok, dtype=torch.bfloat16)).generate(
        prompts, n=4, max_new_tokens=30, seed=0
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scored = score_rollouts(model, prompts, half)
        wrong = score_rollouts(model, prompts, half, temperature=0.5)
    assert 1e-3 < max_gap(half, scored) < BF16_TOL  # really bfloat16, and within the tolerance
    assert mean_gap(half, scored) < BF16_MEAN_TOL
    assert max_gap(half, wrong) > BF16_TOL and mean_gap(half, wrong) > BF16_MEAN_TOL  # the check can fail
    assert half.stats["peak_kv_bytes"] == dense.stats["peak_kv_bytes"] / 2  # the KV cache is bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the packed copy, not the weights


def test_bf16_full_fine_tuning_keeps_float32_master_weights_that_take_tiny_updates(tmp_path: Path):
    """An update far below bfloat16's rounding step (1/256 of a weight) still moves the float32 master weights."""
    cfg = tiny_cfg(tmp_path, "model.dtype=bfloat16", "trainer.steps=1", "optim.lr=1e-6")
    trainer = make_trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.policy.module.named_parameters()}
    trainer.train()
    after = dict(trainer.policy.module.named_parameters())
    assert all(p.dtype == torch.float32 for p in after.values())
    old = torch.cat([before[n].flatten() for n in after])
    new = torch.cat([p.detach().flatten() for p in after.values()])
    changed = old != new
    assert changed.any(), "no weight moved"
    # most of these changes would have been rounded away had the weights been stored in bfloat16
    lost_in_bf16 = old[changed].to(torch.bfloat16) == new[changed].to(torch.bfloat16)
    assert lost_in_bf16.float().mean() > 0.9
    state = trainer.learner.optimizer.state
    assert all(v.dtype == torch.float32 for s in state.values() for v in s.values() if v.dim() > 0)


def test_bf16_mismatch_shows_in_the_correction_metrics(tmp_path: Path):
    """The corrections exist for exactly this mismatch: bfloat16 rollouts show a larger sampler/pi_old KL."""
    kl = {}
    for dtype in ("float32", "bfloat16"):
        cfg = tiny_cfg(
            tmp_path,
            f"model.dtype={dtype}",
            "kv.method=dense",
            "algo.preset=dense",
            "trainer.steps=1",
            name=dtype,
        )
        make_trainer(cfg).train()
        kl[dtype] = [r for r in rows(tmp_path / dtype) if "rollout_corr/kl" in r][0]["rollout_corr/kl"]
    assert kl["bfloat16"] > 100 * max(kl["float32"], 1e-7)


def test_bf16_lora_keeps_a_bfloat16_base_and_float32_adapters(tmp_path: Path):
    cfg = tiny_cfg(tmp_path, "model.dtype=bfloat16", "model.lora=true")
    policy = Policy(cfg.model, seed=0)
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    frozen = [p for p in policy.module.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
