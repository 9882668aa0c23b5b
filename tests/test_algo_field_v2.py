"""The field's newer corrections, losses and mismatch metrics, each against a value computed by hand (in scalars,
not by the library) on a few tokens: the two-sided outlier veto, DeepSeek-V3.2's off-policy sequence mask and
importance-corrected KL, TRL's truncated-completion and entropy masks, Clip-Cov, KL-Cov, Soft Adaptive Policy
Optimization, and the mismatch metrics of verl and NeMo-RL."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from sparserl.algo import AlgoConfig, correction_weights

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
