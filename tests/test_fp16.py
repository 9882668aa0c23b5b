"""float16 that trains: dynamic loss scaling (an overflowing update skipped, the scale lowered, counted, and kept
across a resume), full fine-tuning and LoRA, and model.fp32_lm_head keeping the head's matmul in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer, rows, tiny_cfg, weights

from sparserl.engine.weights import head_logits, packed_projections
from sparserl.trainer.checkpoint import latest_checkpoint, load_checkpoint
from sparserl.trainer.loss_scale import LOSS_SCALE_KEY, DynamicLossScale
from sparserl.trainer.policy import Policy

FP16 = "model.dtype=float16"
HUGE = 2.0**100  # the scaled loss is finite in float32, its backward overflows float16 (max 65504)


def updates(run: Path) -> list[dict]:
    return [r for r in rows(run) if "train/nonfinite_skipped_updates" in r]


def test_an_overflow_skips_the_update_lowers_the_scale_and_is_counted(tmp_path: Path) -> None:
    trainer = make_trainer(tiny_cfg(tmp_path, FP16, "trainer.steps=1"))
    trainer.learner.loss_scale.scale = HUGE
    before = weights(trainer)
    trainer.train()
    (row,) = updates(tmp_path / "run")
    # two mini-batches of 4 samples, both overflowed: neither moved a weight, each halved the scale
    assert row["train/fp16_overflow_skips"] == 2.0
    assert row["train/nonfinite_skipped_updates"] == 0.0  # counted apart from non-finite data
    assert row["train/fp16_loss_scale"] == HUGE / 4 == trainer.learner.loss_scale.scale
    assert all(torch.equal(before[k], v) for k, v in weights(trainer).items())


def test_the_scale_grows_back_after_an_interval_without_overflow() -> None:
    scale = DynamicLossScale(init_scale=8.0, growth_interval=2)
    scale.overflowed()
    scale.stepped()
    assert scale.scale == 4.0
    scale.stepped()
    assert scale.scale == 8.0 and scale.good_steps == 0


@pytest.mark.parametrize("lora", [False, True])
def test_full_fine_tuning_and_lora_train_finite_in_float16(tmp_path: Path, lora: bool) -> None:
    extra = ["model.lora=true", "model.lora_r=4", "optim.lr=1e-2"] if lora else []
    trainer = make_trainer(tiny_cfg(tmp_path, FP16, "trainer.steps=2", *extra))
    before = weights(trainer)
    trainer.train()
    after = weights(trainer)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in after), "no update was taken"
    trained = trainer.policy.trainable_parameters()
    assert all(p.dtype == torch.float32 for p in trained)  # master weights / adapters stay float32
    for row in updates(tmp_path / "run"):
        assert row["train/fp16_overflow_skips"] == 0.0  # the default scale suits the summed loss
        assert all(torch.isfinite(torch.tensor(row[k])) for k in ("actor/loss", "actor/grad_norm"))


def test_resume_equals_an_uninterrupted_float16_run(tmp_path: Path) -> None:
    """The scale is in the checkpoint beside the optimizer, and a resume continues from it: started high, it is
    lowered by the first overflows, so a resume that restarted it at the default would round other gradients."""
    extra = [FP16, "trainer.steps=3"]

    def start(name: str, **kw):
        trainer = make_trainer(tiny_cfg(tmp_path, *extra, name=name), **kw)
        trainer.learner.loss_scale.scale = 2.0**13
        return trainer

    straight = start("straight")
    straight.train()
    first = start("killed")
    first.train(until_step=2)
    cut_at = first.learner.loss_scale.state_dict()
    del first
    saved = load_checkpoint(latest_checkpoint(tmp_path / "killed")).optimizer[LOSS_SCALE_KEY]
    assert saved == cut_at and saved["scale"] != DynamicLossScale().scale
    resumed = make_trainer(
        tiny_cfg(tmp_path, *extra, name="killed"), run_dir=tmp_path / "killed", resume=True
    )
    assert resumed.learner.loss_scale.state_dict() == cut_at
    resumed.train()
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


@pytest.mark.parametrize("lora", [False, True])
def test_fp32_lm_head_changes_the_heads_compute_dtype(tmp_path: Path, lora: bool) -> None:
    def head(*flag: str):
        cfg = tiny_cfg(tmp_path, FP16, f"model.lora={str(lora).lower()}", *flag)
        policy = Policy(cfg.model, seed=0)
        lm_head = policy.module.get_output_embeddings()
        hidden = torch.randn(2, 3, lm_head.in_features, dtype=torch.float16)
        with policy.autocast():
            learner = head_logits(lm_head, hidden)
        layers = policy.module.model.layers
        sampler = packed_projections(policy.module, layers, lm_head, torch.float16)._lm_head
        return learner.dtype, sampler.weight_t.dtype, lm_head.weight.dtype

    assert head() == (torch.float16, torch.float16, torch.float16 if lora else torch.float32)
    on = head("model.fp32_lm_head=true")
    assert on[:2] == (torch.float32, torch.float32)
    assert on[2] == (torch.float16 if lora else torch.float32)  # the weight itself is not converted
