"""SMD (preset smd, algo/smd.py) on hand-made tensors: the faithful-token mask, the loss by hand, where the
gradient goes, the distillation term's direction and its zero, and the preset as a run config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_update import TIGHT, first_step

from sparserl.algo import algo_config, correction_weights, policy_loss, smd_loss
from sparserl.algo.loss import sampler_kl
from sparserl.config import ConfigError, load_config

LOG_HALF = math.log(0.5)


def batch() -> dict[str, torch.Tensor]:
    """Two sequences, the second padded at its last position (NaN there: never read).

    seq 0: log xi = [0, -0.8, 0, 0]: xi = e^-0.8 < 0.5 at t=1 cuts it; t=2, 3 are back in the band but follow the
    divergence, so they are dropped too. seq 1: log xi = [log 0.5 (on the bound: kept), 0, 1 (e > 2: cut)].
    """
    nan = float("nan")
    return {
        "old": torch.tensor([[-1.0, -1.0, -1.0, -1.0], [LOG_HALF, -0.5, -0.5, nan]], dtype=torch.float64),
        "sampler": torch.tensor([[-1.0, -0.2, -1.0, -1.0], [0.0, -0.5, -1.5, nan]], dtype=torch.float64),
        "learner": torch.tensor(
            [[-0.9, -1.0, -1.2, -0.7], [LOG_HALF + 0.3, -0.6, -2.0, nan]], dtype=torch.float64
        ),
        "mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool),
        "adv": torch.tensor([1.0, -1.0], dtype=torch.float64),
    }


def run(cfg, b=None):
    b = b or batch()
    logp = b["learner"].clone().requires_grad_(True)
    loss, metrics = smd_loss(logp, b["old"], b["sampler"], b["mask"], b["adv"], cfg)
    loss.backward()
    return loss, metrics, torch.nan_to_num(logp.grad)


def test_faithful_tokens_are_the_prefix_before_the_first_divergence():
    b = batch()
    _, keep, m = correction_weights(b["old"], b["sampler"], b["mask"], algo_config("smd"))
    assert keep.tolist() == [[True, False, False, False], [True, True, False, False]]
    assert m["rollout_corr/prefix_rs_masked_fraction"] == pytest.approx(4 / 7)
    assert m["rollout_corr/prefix_rs_cut_fraction"] == 1.0
    # token rejection with the same band would keep seq 0's t=2, 3: the prefix rule is not token_rs
    band = algo_config("tis", token_rs_low=0.5, token_rs_high=2.0, tis_cap=None)
    _, token_keep, _ = correction_weights(b["old"], b["sampler"], b["mask"], band)
    assert token_keep[0].tolist() == [True, False, True, True]


def test_loss_by_hand():
    loss, m, _ = run(algo_config("smd", kl_coef=0.0))
    # Track 1, PPO (eps 0.2) on the kept tokens, token mean per sequence, mean over the 2 sequences
    r00, r10, r11 = math.exp(0.1), math.exp(0.3), math.exp(-0.1)
    seq0 = -r00  # A = +1, r inside the clip
    seq1 = (max(r10, 1.2) + r11) / 2  # A = -1: max(r, clip(r)) per token
    pg = (seq0 + seq1) / 2
    # Track 2, hinge max(0, log pi_sparse - log pi_theta) over every response token
    hinge0 = (0.0 + 0.8 + 0.2 + 0.0) / 4
    hinge1 = (-(LOG_HALF + 0.3) + 0.1 + 0.5) / 3
    kl = (hinge0 + hinge1) / 2
    assert m["actor/pg_loss"] == pytest.approx(pg, abs=1e-12)
    assert m["actor/sampler_kl"] == pytest.approx(kl, abs=1e-12)
    assert loss.item() == pytest.approx(pg + 0.1 * kl, abs=1e-12)
    assert m["actor/kept_tokens"] == 3.0


def test_policy_gradient_only_through_kept_tokens():
    _, _, grad = run(algo_config("smd", kl_coef=0.0, sampler_kl_coef=0.0))
    assert (grad != 0).tolist() == [[True, False, False, False], [True, True, False, False]]
    assert float(grad[0, 0]) == pytest.approx(-math.exp(0.1) / 2)  # d/dlogp of -r A / (1 token x 2 seqs)
    # the distillation term reaches every response token, kept or not, where the hinge is active; never padding
    _, _, grad = run(algo_config("smd", kl_coef=0.0))
    assert float(grad[0, 1]) == pytest.approx(-0.1 / 4 / 2)  # dropped token, hinge active: -lambda / (4 x 2)
    assert float(grad[0, 3]) == 0.0 and float(grad[1, 3]) == 0.0  # hinge inactive; padding


def test_distillation_pulls_the_learner_toward_the_sampler_which_gets_no_gradient():
    logp = torch.tensor([[-2.0, -0.5]], requires_grad=True)
    samp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    for estimator in ("hinge", "kl"):
        logp.grad = None
        sampler_kl(logp, samp, estimator, 20.0).sum().backward()
        assert float(logp.grad[0, 0]) < 0  # below the sampler: descent raises pi_theta toward pi_sparse
        assert samp.grad is None  # stop-gradient on the sparse side, as the paper writes it
    assert float(logp.grad[0, 1]) > 0  # 'kl' also lowers a token the learner over-weights
    logp.grad = None
    sampler_kl(logp, samp, "hinge", 20.0).sum().backward()
    assert float(logp.grad[0, 1]) == 0.0  # the authors' hinge is one-sided
    # and its gradient does not shrink as the two approach: -1 however slightly the learner is below
    near = torch.tensor([[-1.0 - 1e-6]], dtype=torch.float64, requires_grad=True)
    sampler_kl(near, torch.tensor([[-1.0]], dtype=torch.float64), "hinge", 20.0).sum().backward()
    assert float(near.grad) == -1.0


def test_kl_estimator_is_kl_dense_to_sparse_on_the_samplers_draws():
    """Enumerated over a 3-token vocabulary: E_{v ~ pi_sparse}[D(v)] and its gradient are KL(pi_theta || pi_sparse)
    and its gradient exactly (the paper's direction), not KL(pi_sparse || pi_theta)."""
    z = torch.tensor([0.3, -1.0, 0.7], dtype=torch.float64, requires_grad=True)
    s = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logp = z.log_softmax(-1)
    expected = (logp.exp() * (logp - s.log())).sum()
    (g_expected,) = torch.autograd.grad(expected, z, retain_graph=True)
    estimate = (s * sampler_kl(logp[None], s.log()[None], "kl", 20.0)[0]).sum()
    (g_estimate,) = torch.autograd.grad(estimate, z)
    assert estimate.item() == pytest.approx(expected.item(), abs=1e-12)
    assert torch.allclose(g_estimate, g_expected, atol=1e-12)
    reverse = (s * (s.log() - logp)).sum()
    assert abs(reverse.item() - expected.item()) > 1e-3  # the two directions differ here


def test_zero_when_the_sampler_agrees_with_the_dense_policy():
    b = batch()
    b["sampler"] = b["old"].clone()
    for estimator in ("hinge", "kl"):
        logp = b["old"].clone().requires_grad_(True)
        d = sampler_kl(logp, b["old"], estimator, 20.0)
        d.nansum().backward()
        assert torch.nan_to_num(d).abs().max() == 0.0 and torch.nan_to_num(logp.grad).abs().max() == 0.0
        # nothing cut and the distillation term 0: SMD is then the plain PPO loss
        loss, m, _ = run(algo_config("smd", kl_coef=0.0, sampler_kl_estimator=estimator), b)
        logp = b["learner"].clone().requires_grad_(True)
        plain, _ = policy_loss(logp, b["old"], b["adv"], b["mask"], None, algo_config("dense", kl_coef=0.0))
        assert m["rollout_corr/prefix_rs_masked_fraction"] == 0.0
        assert loss.item() == pytest.approx(plain.item() + 0.1 * m["actor/sampler_kl"], abs=1e-12)


def test_preset_loads_and_validates():
    cfg = load_config(None, ["algo.preset=smd"])
    assert cfg.algo.preset == "smd" and cfg.algo.sparse_rollout and cfg.algo.correction_mode == "decoupled"
    assert (cfg.algo.prefix_rs_low, cfg.algo.prefix_rs_high) == (0.5, 2.0)
    assert (cfg.algo.sampler_kl_coef, cfg.algo.sampler_kl_estimator) == (0.1, "hinge")
    assert load_config(None, ["algo.preset=smd", "algo.sampler_kl_coef=0.3"]).algo.sampler_kl_coef == 0.3
    with pytest.raises(ConfigError, match="algo.sampler_kl_estimator='abs' is unknown"):
        load_config(None, ["algo.preset=smd", "algo.sampler_kl_estimator=abs"])
    with pytest.raises(ConfigError, match="algo.prefix_rs_low=3.0 must be <= algo.prefix_rs_high=2.0"):
        load_config(None, ["algo.preset=smd", "algo.prefix_rs_low=3"])
    with pytest.raises(ConfigError, match="algo.sampler_kl_coef=-0.1 must be >= 0"):
        load_config(None, ["algo.preset=smd", "algo.sampler_kl_coef=-0.1"])
    with pytest.raises(ConfigError, match="ignores algo.prefix_rs_low"):
        load_config(None, ["algo.preset=naive-sparse", "algo.prefix_rs_low=0.5"])


def test_distillation_without_sampler_logprobs_is_refused():
    b = batch()
    with pytest.raises(ValueError, match="algo.sampler_kl_coef=0.1 > 0 needs logp_sampler"):
        policy_loss(b["learner"], b["old"], b["adv"], b["mask"], None, algo_config("smd", kl_coef=0.0))


def test_training_step_feeds_the_sampler_logprobs_to_the_distillation_term(tmp_path: Path) -> None:
    """One step of the tiny run with algo.preset=smd on a tight KV budget: the trainer passes the sampler's
    log-probs, so the distillation term is computed and the prefix rule cuts the mismatched tokens."""
    row = first_step(tmp_path, "algo.preset=smd", "optim.mini_batch_size=0", *TIGHT, name="smd")
    assert row["rollout_corr/kl"] > 0.01  # mismatched, so there is something to cut and to distil
    assert 0.0 < row["rollout_corr/prefix_rs_masked_fraction"] < 1.0
    assert row["actor/sampler_kl"] > 0.0 and math.isfinite(row["actor/loss"])
