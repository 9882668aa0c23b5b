"""DAPO's pieces outside sampling: the overlong penalty against its formula, the dapo preset, and both through
the trainer."""

from __future__ import annotations

import pytest
import torch

from sparserl.algo import algo_config
from sparserl.algo.reward_shaping import overlong_penalty
from tests.test_trainer import make_trainer, rows, tiny_cfg


def test_overlong_penalty_matches_dapo():
    """DAPO: r_length = 0 if L <= L_max - L_cache; ((L_max - L_cache) - L) / L_cache inside the buffer."""
    lengths = torch.tensor([0, 10, 12, 13, 16, 20])
    caps = torch.full((6,), 20)
    got = overlong_penalty(lengths, caps, buffer=8, penalty=0.5)
    want = [0.0, 0.0, 0.0, 0.5 * (12 - 13) / 8, 0.5 * (12 - 16) / 8, -0.5]
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-7)
    assert torch.equal(overlong_penalty(lengths, caps, buffer=0), torch.zeros(6))


def test_each_sample_is_penalised_against_its_own_cap():
    got = overlong_penalty(torch.tensor([10, 10]), torch.tensor([10, 40]), buffer=4)
    assert got.tolist() == [-1.0, 0.0]


def test_dapo_preset_is_clip_higher_token_mean_no_kl():
    cfg = algo_config("dapo")
    assert (cfg.eps_low, cfg.eps_high, cfg.loss_agg_mode, cfg.kl_coef) == (0.2, 0.28, "token-mean", 0.0)


def test_bad_overlong_values_name_their_key():
    with pytest.raises(ValueError, match="algo.overlong_buffer=-1"):
        algo_config("dense", overlong_buffer=-1)


def test_overlong_shaping_reaches_the_advantages(tmp_path):
    """Every tiny-model completion runs to its cap of 12 tokens: with a buffer all are penalised alike."""
    extra = ("algo.preset=dapo", "algo.overlong_buffer=6", "algo.overlong_penalty=0.5", "trainer.steps=1")
    trainer = make_trainer(tiny_cfg(tmp_path, *extra))
    trainer.train()
    (row,) = [r for r in rows(tmp_path / "run") if "reward/overlong_penalty" in r]
    lengths = row["length/mean"]
    assert row["reward/overlong_penalty"] == pytest.approx(
        -0.5 * min(1.0, max(0.0, lengths - 6) / 6), abs=0.1
    )
