"""The field's newer corrections, losses and mismatch metrics, each against a value computed by hand (in scalars,
not by the library) on a few tokens: the two-sided outlier veto, DeepSeek-V3.2's off-policy sequence mask and
importance-corrected KL, TRL's truncated-completion and entropy masks, Clip-Cov, KL-Cov, Soft Adaptive Policy
Optimization, and the mismatch metrics of verl and NeMo-RL."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from sparserl.algo import AlgoConfig, algo_config, correction_weights, policy_loss
from sparserl.config import load_config

D = torch.float64
P = "rollout_corr/"


def _probs(p_old: list[list[float]], p_samp: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi_old and log pi_sparse of the sampled tokens from their probabilities."""
    return torch.tensor(p_old, dtype=D).log(), torch.tensor(p_samp, dtype=D).log()


# ---- mismatch metrics ----------------------------------------------------------------------------------------

# three tokens with xi = 1, 2, 0.5, then padding that must not count
P_OLD, P_SAMP = [[0.5, 0.5, 0.1, 0.9]], [[0.5, 0.25, 0.2, 0.1]]
MASK3 = torch.tensor([[True, True, True, False]])


def test_mismatch_metrics_of_verl_and_nemo_rl_by_hand():
    old, samp = _probs(P_OLD, P_SAMP)
    _, _, m = correction_weights(old, samp, MASK3, AlgoConfig())
    xi = [1.0, 2.0, 0.5]
    assert m[P + "token_mult_prob_error"] == pytest.approx((1 + 2 + 2) / 3)  # exp|log xi| = max(xi, 1/xi)
    assert m[P + "gen_kl_error"] == pytest.approx(sum(x - 1 - math.log(x) for x in xi) / 3) == 1 / 6
    assert m[P + "policy_kl_error"] == pytest.approx(sum(1 / x - 1 + math.log(x) for x in xi) / 3)
    # JS per token: r1 + r2 = 2 for r = p / m, so 0.5 (k3(r1) + k3(r2)) = -0.5 log(r1 r2); tokens 2 and 3 give
    # r = (4/3, 2/3) and (2/3, 4/3): each 0.5 log(9/8)
    assert m[P + "js_divergence_error"] == pytest.approx(math.log(9 / 8) / 3)
    r = statistics.correlation([0.5, 0.5, 0.1], [0.5, 0.25, 0.2])
    assert m[P + "pearson_corr"] == pytest.approx(r) and 0.62 < r < 0.63
    assert m[P + "xi_std"] == pytest.approx(math.sqrt(7 / 18))  # xi mean 7/6: deviations -1/6, 5/6, -2/3


def test_is_ratio_before_and_after_the_corrections():
    """Before: xi over every valid token; after: the applied weight (TIS cap 1.5) over the kept tokens."""
    old, samp = _probs(P_OLD, P_SAMP)
    cfg = AlgoConfig(correction_mode="decoupled", tis_cap=1.5)
    _, _, m = correction_weights(old, samp, MASK3, cfg)
    assert (m[P + "xi_max"], m[P + "weight_max"]) == pytest.approx((2.0, 1.5))
    assert (m[P + "xi_min"], m[P + "weight_min"]) == pytest.approx((0.5, 0.5))
    assert m[P + "weight_mean"] == pytest.approx(1.0)  # (1 + 1.5 + 0.5) / 3
    assert m[P + "weight_std"] == pytest.approx(math.sqrt((0 + 0.25 + 0.25) / 3))


@pytest.mark.parametrize(
    ("p_old", "p_samp", "mask", "r"),
    [
        ([[0.5, 0.2]], [[0.4, 0.2]], [[True, False]], 0.0),  # one token: r undefined, the sides differ
        ([[0.4, 0.2]], [[0.4, 0.2]], [[True, False]], 1.0),  # one token, equal
        ([[0.5, 0.2]], [[0.4, 0.4]], [[True, True]], 0.0),  # the sampler's side constant
        ([[0.5, 0.2]], [[0.4, 0.2]], [[False, False]], 1.0),  # no token
    ],
)
def test_pearson_corr_where_it_is_undefined(p_old, p_samp, mask, r):
    old, samp = _probs(p_old, p_samp)
    _, _, m = correction_weights(old, samp, torch.tensor(mask), AlgoConfig())
    assert m[P + "pearson_corr"] == r


def test_no_valid_token_gives_the_neutral_values():
    old, samp = _probs([[0.5, 0.2]], [[0.4, 0.2]])
    _, _, m = correction_weights(old, samp, torch.zeros(1, 2, dtype=torch.bool), AlgoConfig())
    assert m[P + "token_mult_prob_error"] == 1.0
    assert m[P + "js_divergence_error"] == m[P + "policy_kl_error"] == m[P + "xi_std"] == 0.0


# ---- two-sided outlier veto (SkyRL) --------------------------------------------------------------------------


def _xi(rows: list[list[float]], mask: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log pi_old, log pi_sparse (at log-prob 0, so log xi is exact) and the mask, for the given xi."""
    log_xi = torch.tensor(rows, dtype=D).log()
    return log_xi, torch.zeros_like(log_xi), torch.tensor(mask, dtype=torch.bool)


def test_outlier_veto_drops_a_sequence_for_one_token_outside_either_bound():
    # seq 0: 3.0 > 2.5; seq 1: 0.3 < 0.4; seq 2: on both bounds (kept: inclusive); seq 3: its outlier is padding
    old, samp, mask = _xi(
        [[1.0, 0.5, 3.0], [0.3, 1.0, 1.0], [0.4, 2.5, 1.0], [1.0, 1.0, 1000.0]],
        [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]],
    )
    cfg = AlgoConfig(
        correction_mode="decoupled", outlier_token_is_threshold_low=0.4, outlier_token_is_threshold_high=2.5
    )
    w, keep, m = correction_weights(old, samp, mask, cfg)
    assert keep.tolist() == [[False] * 3, [False] * 3, [True] * 3, [True, True, False]]
    assert torch.equal(w, keep.to(D))  # a veto weights nothing
    assert m[P + "outlier_seq_masked_fraction"] == 0.5
    assert m[P + "outlier_seq_under_low_fraction"] == m[P + "outlier_seq_over_high_fraction"] == 0.25
    one_sided = AlgoConfig(correction_mode="decoupled", outlier_token_is_threshold_high=2.5)
    assert correction_weights(old, samp, mask, one_sided)[1][:, 0].tolist() == [False, True, True, True]


def test_outlier_veto_bounds_are_checked():
    with pytest.raises(ValueError, match="outlier_token_is_threshold_low=3.0 must be <="):
        AlgoConfig(
            correction_mode="decoupled",
            outlier_token_is_threshold_low=3.0,
            outlier_token_is_threshold_high=2.0,
        )
    with pytest.raises(
        ValueError, match="correction_mode='none' ignores algo.outlier_token_is_threshold_low"
    ):
        AlgoConfig(outlier_token_is_threshold_low=1e-4)


@pytest.mark.parametrize(
    ("name", "t", "stat"),
    [
        ("seq_max_k2", 0.08, lambda x: x * x / 2),
        ("seq_max_k3", 0.05, lambda x: math.expm1(x) - x),
    ],
)
def test_verl_seq_max_names_are_the_outlier_veto(name, t, stat):
    """verl keeps a sequence whose largest per-token statistic of log r = log xi is <= t."""
    log_xi = [[0.2, -0.3, 0.0], [0.2, 0.45, 0.0], [-0.41, 0.0, 0.0], [0.35, 0.1, 0.0], [0.1, 0.1, 5.0]]
    mask = [[1, 1, 1]] * 4 + [[1, 1, 0]]
    old, samp = torch.tensor(log_xi, dtype=D), torch.zeros(5, 3, dtype=D)
    cfg = AlgoConfig(correction_mode="decoupled", rollout_rs=[f"{name}:{t}"])
    _, keep, _ = correction_weights(old, samp, torch.tensor(mask, dtype=torch.bool), cfg)
    want = [
        max(stat(x) for x, b in zip(row, bits, strict=True) if b) <= t
        for row, bits in zip(log_xi, mask, strict=True)
    ]
    assert keep.any(dim=1).tolist() == want
    assert True in want and False in want  # the rule bites, and not everywhere


# ---- losses: Soft Adaptive Policy Optimization, Clip-Cov, KL-Cov -------------------------------------------

NOKL = {"kl_coef": 0.0}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _loss(lp_rows, old_rows, adv, cfg, mask=None):
    """policy_loss (seq-mean-token-mean, no weights) and its gradient with respect to log pi_theta."""
    lp = torch.tensor(lp_rows, dtype=D, requires_grad=True)
    old = torch.tensor(old_rows, dtype=D)
    m = torch.ones_like(old, dtype=torch.bool) if mask is None else torch.tensor(mask)
    loss, metrics = policy_loss(lp, old, torch.tensor(adv, dtype=D), m, None, cfg)
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
