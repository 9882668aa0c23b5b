"""The field's newer corrections and mismatch metrics, each against a value computed by hand (in scalars, not by
the library) on a few tokens: the two-sided outlier veto (and verl's seq_max names for it), the IS ratio before
and after the corrections, and the mismatch metrics of verl and NeMo-RL. The losses and masks of the same
round: tests/test_algo_field_v2_losses.py."""

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
