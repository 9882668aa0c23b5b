"""The second review's fixes: a NaN sampler log-prob skipped under every preset, FSDP with a variable batch size
refused at start-up, the broadcast group re-formed between runs, rollout throughput over the rounds' wall time,
GSPO with token-mean warned about, SPEC-RL with APRIL refused, uniqueness judged on the task reward, token-level
advantages whitened without their padding, the SAPO pool named per run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer, rows, tiny_cfg, weights

from sparserl.trainer.update import Learner

# ---------------------------------------------------------------- the learner


@pytest.mark.parametrize(
    "rules",
    [
        ["algo.preset=sparse-rl"],
        ["algo.preset=dense", "kv.method=dense"],
        ["algo.preset=smd"],
        ["algo.preset=geo-rs"],
        ["algo.correction_mode=bypass"],
    ],
)
def test_a_nan_sampler_log_prob_is_skipped_and_counted_under_every_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rules: list[str]
) -> None:
    real = Learner.update

    def poisoned(self, step, batch):
        if step == 1:
            batch.logp_sampler[0, :] = float("nan")
        return real(self, step, batch)

    monkeypatch.setattr(Learner, "update", poisoned)
    trainer = make_trainer(tiny_cfg(tmp_path, "optim.mini_batch_size=0", "trainer.steps=2", *rules))
    trainer.train()
    logged = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["train/nonfinite_skipped_updates"] for r in logged] == [1.0, 0.0]
    assert all(torch.isfinite(v).all() for v in weights(trainer).values())
