"""The field's newer losses and masks against values computed by hand (in scalars, not by the library) on a few
tokens, and the paper's formula where it gives one: Soft Adaptive Policy Optimization, Clip-Cov, KL-Cov,
DeepSeek-V3.2's off-policy sequence mask, unbiased KL and keep-sampling mask, TRL's truncated-completion and
top-entropy masks (and the learner's wiring of the last two)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sparserl.algo import AlgoConfig, algo_config, kl_penalty, policy_loss
from sparserl.algo.keep_sampling import keep_sampling_logprobs, pack_kept, unpack_kept
from sparserl.algo.token_masks import truncated_completion_mask
from sparserl.config import load_config

D = torch.float64


# ---- Soft Adaptive Policy Optimization, Clip-Cov, KL-Cov ---------------------------------------------------

NOKL = {"kl_coef": 0.0}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _loss(lp_rows, old_rows, adv, cfg, mask=None, **inputs):
    """policy_loss (seq-mean-token-mean, no weights; `inputs` its optional tensors) and its gradient with
    respect to log pi_theta."""
    lp = torch.tensor(lp_rows, dtype=D, requires_grad=True)
    old = torch.tensor(old_rows, dtype=D)
    m = torch.ones_like(old, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, metrics = policy_loss(lp, old, torch.tensor(adv, dtype=D), m, None, cfg, **inputs)
    loss.backward()
    return loss.item(), lp.grad, metrics


def _close(x: torch.Tensor, rows: list[list[float]]) -> None:
    torch.testing.assert_close(x, torch.tensor(rows, dtype=D))


def test_soft_sapo_is_the_papers_gate_in_value_and_gradient():
    """SAPO: loss -f(r) A, f(r) = (4 / tau) sigmoid(tau (r - 1)); d/dlog pi = -4 s (1 - s) r A, s the sigmoid."""
    cfg = AlgoConfig(policy_loss="soft_sapo", tau_pos=1.0, tau_neg=1.05, **NOKL)
    loss, grad, m = _loss([[-1.0], [-0.5]], [[-1.2], [-0.5]], [1.0, -2.0], cfg)
    r0 = math.exp(0.2)
    s0, s1 = _sigmoid(1.0 * (r0 - 1)), _sigmoid(1.05 * 0.0)
    assert loss == pytest.approx((-4.0 * s0 * 1.0 + -(4 / 1.05) * s1 * -2.0) / 2)
    assert grad[0, 0].item() == pytest.approx(-4 * s0 * (1 - s0) * r0 * 1.0 / 2)
    assert grad[1, 0].item() == pytest.approx(-4 * 0.25 * 1.0 * -2.0 / 2)  # r = 1: PPO's gradient, -A
    assert m["actor/pg_clipfrac"] == 0.0


def test_soft_sapo_names_and_trls_keys():
    assert AlgoConfig(policy_loss="sapo_loss").policy_loss == "soft_sapo"
    with pytest.raises(ValueError, match="swarm sharing of rollouts"):
        AlgoConfig(policy_loss="sapo")
    cfg = algo_config("dense", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0)
    assert (cfg.tau_pos, cfg.tau_neg) == (0.5, 2.0)
    with pytest.raises(ValueError, match="one key"):
        algo_config("dense", tau_pos=1.0, sapo_temperature_pos=0.5)
    run = load_config(None, ["algo.sapo_temperature_neg=1.5", "algo.policy_loss=sapo_loss"])
    assert (run.algo.tau_neg, run.algo.policy_loss) == (1.5, "soft_sapo")


# Covariance batch: A = +1, -1 per sequence (mean 0), log pi - mean log pi = [[1.5, -1.5], [-0.5, 0.5]], so the
# per-token covariance terms are [[1.5, -1.5], [0.5, -0.5]]; with (lb, ub) = (1, 5) only token (0, 0) qualifies.
COV_LP, COV_ADV = [[-0.5, -3.5], [-2.5, -1.5]], [1.0, -1.0]


def test_clip_cov_cuts_the_gradient_of_the_token_in_the_covariance_band():
    cfg = AlgoConfig(policy_loss="clip_cov", **NOKL)
    loss, grad, m = _loss(COV_LP, COV_LP, COV_ADV, cfg)  # ratio 1: the PPO clip is idle
    assert loss == pytest.approx(((0.0 - 1.0) / 2 + (1.0 + 1.0) / 2) / 2)  # token (0, 0)'s -A r is gone
    _close(grad, [[0.0, -0.25], [0.25, 0.25]])  # -A r / (n_i B) elsewhere
    assert m["actor/pg_clipfrac"] == 0.25


def test_clip_cov_leaves_a_ppo_clipped_token_to_the_clip():
    old = [[-0.8, -3.5], [-2.5, -1.5]]  # token (0, 0): r = e^0.3 > 1.2 with A > 0: PPO clips it, no gradient
    loss, grad, m = _loss(COV_LP, old, COV_ADV, AlgoConfig(policy_loss="clip_cov", **NOKL))
    assert loss == pytest.approx(((-1.2 - 1.0) / 2 + 1.0) / 2)
    _close(grad, [[0.0, -0.25], [0.25, 0.25]])
    assert m["actor/pg_clipfrac"] == 0.25


def test_clip_cov_draws_its_share_among_more_candidates():
    cfg = AlgoConfig(policy_loss="clip_cov", clip_cov_lb=0.1, **NOKL)  # tokens (0, 0) and (1, 0) qualify
    for seed in range(4):
        torch.manual_seed(seed)
        _, grad, m = _loss(COV_LP, COV_LP, COV_ADV, cfg)
        assert m["actor/pg_clipfrac"] == 0.25  # max(1, int(2e-4 x 4)) = 1 of the 2
        assert (grad == 0).sum() == 1 and (grad[0, 0] == 0) != (grad[1, 0] == 0)


def test_kl_cov_penalises_the_largest_covariance_tokens():
    """KL-Cov: -A r + ppo_kl_coef |log pi - log pi_old| at the top-k covariance tokens, -A r elsewhere."""
    old = [[-0.7, -3.5], [-2.5, -1.5]]  # token (0, 0): log r = 0.2
    cfg = AlgoConfig(policy_loss="kl_cov", ppo_kl_coef=1.0, **NOKL)  # k = max(1, int(2e-4 x 4)) = 1
    loss, grad, m = _loss(COV_LP, old, COV_ADV, cfg)
    r = math.exp(0.2)
    assert loss == pytest.approx(((-r + 0.2 - 1.0) / 2 + (1.0 + 1.0) / 2) / 2)
    assert grad[0, 0].item() == pytest.approx((-r + 1.0) / 4)
    assert m["actor/pg_clipfrac"] == 0.25
    two = AlgoConfig(policy_loss="kl_cov", kl_cov_ratio=0.5, ppo_kl_coef=3.0, **NOKL)  # k = 2: (0,0), (1,0)
    _, grad2, m2 = _loss(COV_LP, [[-0.7, -3.5], [-2.6, -1.5]], COV_ADV, two)
    assert grad2[1, 0].item() == pytest.approx((1.0 * math.exp(0.1) + 3.0) / 4)
    assert m2["actor/pg_clipfrac"] == 0.5


def test_kl_cov_without_covariance_penalises_nothing():
    _, grad, m = _loss(
        COV_LP, [[-0.7, -3.5], [-2.5, -1.5]], [0.0, 0.0], AlgoConfig(policy_loss="kl_cov", **NOKL)
    )
    assert m["actor/pg_clipfrac"] == 0.0 and torch.equal(grad, torch.zeros_like(grad))


# ---- DeepSeek-V3.2: off-policy sequence mask, unbiased KL, keep-sampling mask ------------------------------


def test_off_policy_mask_drops_the_policy_term_of_negative_far_off_sequences():
    """M_i = 0 iff A_i < 0 and mean_t log(pi_sampler / pi_theta) > delta; the sequence still counts in the
    denominator (the paper's 1/G sum_i ... M_i)."""
    lp = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]]
    samp = torch.tensor([[-0.2, -0.6], [-0.8, -0.6], [0.0, -0.4]], dtype=D)  # KL 0.6, 0.3, 0.8 nats a token
    cfg = AlgoConfig(off_policy_mask_threshold=0.5, **NOKL)
    loss, grad, m = _loss(lp, lp, [-1.0, -2.0, 1.0], cfg, logp_sampler=samp)
    assert loss == pytest.approx((0.0 + 2.0 - 1.0) / 3)  # -A r: sequence 0's policy term is gone
    _close(grad, [[0.0, 0.0], [1 / 3, 1 / 3], [-1 / 6, -1 / 6]])
    assert m["actor/off_policy_masked_fraction"] == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="needs logp_sampler"):
        _loss(lp, lp, [-1.0, -2.0, 1.0], cfg)


def test_off_policy_mask_reads_per_token_advantages_and_leaves_the_kl():
    lp, samp = [[-1.0, -1.0]], torch.tensor([[0.0, 0.0]], dtype=D)  # KL 1 nat a token
    cfg = AlgoConfig(off_policy_mask_threshold=0.5, kl_coef=1.0)
    ref = torch.tensor([[-1.5, -1.5]], dtype=D)
    _, grad, m = _loss(lp, lp, [[-1.0, 1.0]], cfg, logp_sampler=samp, logp_ref=ref)
    k3_grad = 1 - math.exp(-0.5)  # d/dlp of exp(ref - lp) + (lp - ref) - 1
    _close(grad, [[k3_grad / 2, (-1.0 + k3_grad) / 2]])  # token 0 keeps only the KL's gradient
    assert m["actor/off_policy_masked_fraction"] == 0.5


def test_k3_is_is_the_importance_weighted_k3_and_unbiased_under_pi_old():
    """DeepSeek-V3.2: KL_t = (pi_theta / pi_old)(pi_ref / pi_theta - log(pi_ref / pi_theta) - 1); its gradient
    is r log(pi_theta / pi_ref) grad log pi_theta, and its mean over draws of pi_old is KL(pi_theta || pi_ref)."""
    cfg = AlgoConfig(kl_estimator="k3_is", kl_coef=1.0)
    lp, old, ref = [[-1.0]], [[-1.2]], torch.tensor([[-1.5]], dtype=D)
    loss, grad, m = _loss(lp, old, [0.0], cfg, logp_ref=ref)
    r, d = math.exp(0.2), 0.5
    assert loss == pytest.approx(r * (math.exp(-d) + d - 1)) == m["actor/kl_ref"]
    assert grad[0, 0].item() == pytest.approx(r * d)
    # a whole three-token vocabulary, each token weighted by pi_old: the expectation the estimator targets
    p_theta, p_old, p_ref = (
        torch.tensor(p, dtype=D) for p in ([0.7, 0.2, 0.1], [0.1, 0.2, 0.7], [0.2, 0.2, 0.6])
    )
    kl = sum(a * math.log(a / b) for a, b in zip(p_theta.tolist(), p_ref.tolist(), strict=True))
    weighted = {est: float((p_old * kl_penalty(p_theta.log(), p_ref.log(), est, 10.0, p_old.log())).sum())
                for est in ("k3_is", "k3")}  # fmt: skip
    assert weighted["k3_is"] == pytest.approx(kl)
    assert weighted["k3"] > 2 * kl  # plain k3 under pi_old's draws is biased (2.30 against 0.70)
    with pytest.raises(ValueError, match="needs logp_old"):
        kl_penalty(p_theta.log(), p_ref.log(), "k3_is", 10.0)


def test_keep_sampling_mask_renormalises_over_the_kept_set():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = torch.tensor([[-0.3, -1.4, float("-inf"), float("-inf")]])  # top-2 kept
    kept = unpack_kept(pack_kept(sampler), 4)
    assert kept.tolist() == [[True, True, False, False]]
    got = keep_sampling_logprobs(logits, kept, torch.tensor([1]))
    assert got.item() == pytest.approx(1.0 - math.log(math.exp(2.0) + math.exp(1.0)))
    assert keep_sampling_logprobs(logits, kept, torch.tensor([2])).item() == float("-inf")


# ---- TRL: truncated completions, top-entropy tokens ---------------------------------------------------------


def test_truncated_completions_leave_the_loss_mask():
    mask = torch.ones(3, 2, dtype=torch.bool)
    truncated = torch.tensor([False, True, False])
    on = AlgoConfig(mask_truncated_completions=True)
    assert truncated_completion_mask(mask, truncated, on).tolist() == [
        [True, True],
        [False, False],
        [True, True],
    ]
    assert torch.equal(truncated_completion_mask(mask, None, AlgoConfig()), mask)
    with pytest.raises(ValueError, match="which completions hit their length cap"):
        truncated_completion_mask(mask, None, on)


def test_top_entropy_quantile_keeps_the_policy_term_of_the_high_entropy_tokens():
    """TRL: threshold = quantile(entropies, 1 - rho) with linear interpolation: sorted 0.1, 0.3, 0.5, 0.9 at
    rho 0.5 give 0.3 + 0.5 (0.5 - 0.3) = 0.4; the tokens at 0.1 and 0.3 lose their policy term."""
    ent = torch.tensor([[0.1, 0.5], [0.9, 0.3], [2.0, 2.0]], dtype=D)
    mask = [[True, True], [True, True], [False, False]]  # padding's entropy must not move the quantile
    cfg = AlgoConfig(top_entropy_quantile=0.5, **NOKL)
    loss, grad, m = _loss([[-1.0] * 2] * 3, [[-1.0] * 2] * 3, [1.0, -2.0, 0.0], cfg, mask=mask, entropy=ent)
    assert loss == pytest.approx(((0 - 1.0) / 2 + (2.0 + 0) / 2) / 3)  # the empty row counts (the default)
    _close(grad, [[0.0, -1 / 6], [1 / 3, 0.0], [0.0, 0.0]])
    assert m["actor/entropy_masked_fraction"] == 0.5
    assert cfg.needs_entropy and not AlgoConfig().needs_entropy
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        _loss([[-1.0]], [[-1.0]], [1.0], cfg)


def test_the_learner_masks_truncated_completions_and_reads_entropies(tmp_path: Path):
    """Through Learner.update: a truncated row leaves the loss, and the entropies the quantile needs are
    computed without an entropy bonus."""
    from tests.test_trainer import make_trainer, tiny_cfg

    cfg = tiny_cfg(tmp_path, "algo.mask_truncated_completions=true", "algo.top_entropy_quantile=0.5",
                   "algo.preset=dense", "optim.mini_batch_size=0", "optim.grad_accum=1")  # fmt: skip
    trainer = make_trainer(cfg)
    try:
        batch, _ = trainer.rollout(1)
        batch.truncated = torch.zeros(len(batch.prompts), dtype=torch.bool)
        batch.truncated[0] = True
        out = trainer.learner.update(1, batch)
    finally:
        trainer.close()
    assert out["actor/kept_tokens"] == int(batch.mask.sum() - batch.mask[0].sum())
    assert 0.3 < out["actor/entropy_masked_fraction"] <= 0.5 and "actor/entropy" in out
