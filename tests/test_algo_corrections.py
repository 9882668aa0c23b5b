"""correction_weights: hand-computed Sparse-RL example, every field rule, raw metrics, edge cases, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl.algo import PRESETS, AlgoConfig, algo_config, correction_weights, ppo_anchor

D = torch.float64


def make(
    xi_rows: list[list[float]], mask_rows: list[list[int]], base: float = -1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logp_old, logp_sampler, mask with pi_old / pi_sparse = the given xi (sampler at log-prob `base`;
    base 0 makes the log-ratio exactly log xi, for tests on the bounds)."""
    xi = torch.tensor(xi_rows, dtype=D)
    samp = torch.full_like(xi, base)
    old = samp + xi.log()
    return old, samp, torch.tensor(mask_rows, dtype=torch.bool)


def dec(**kw) -> AlgoConfig:
    return AlgoConfig(correction_mode="decoupled", **kw)


# seq 0: token RS drops 0.4 (low) and 2.0 (high); seq 1: one token below the veto -> whole sequence rejected.
XI = [[1.0, 1.2, 0.4, 2.0], [1.0, 0.8, 5e-5, 1.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


def test_sparse_rl_hand_computed():
    old, samp, mask = make(XI, MASK)
    w, keep, m = correction_weights(old, samp, mask, algo_config("sparse-rl"))
    # truncated weights over the 7 originally valid tokens define the batch-normalisation factor
    factor = (1.0 + 1.2 + 0.4 + 1.5 + 1.0 + 0.8 + 5e-5) / 7
    torch.testing.assert_close(
        w, torch.tensor([[1.0, 1.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=D) / factor
    )
    assert keep.tolist() == [[True, True, False, False], [False, False, False, False]]
    p = "rollout_corr/"
    assert m[p + "batch_norm_factor"] == pytest.approx(factor)
    assert m[p + "seq_rejection_rate"] == 0.5
    assert m[p + "veto_fraction"] == 0.5
    assert m[p + "catastrophic_token_fraction"] == pytest.approx(1 / 7)
    assert m[p + "token_rs_masked_fraction_low"] == pytest.approx(2 / 7)  # 0.4 and 5e-5
    assert m[p + "token_rs_masked_fraction_high"] == pytest.approx(1 / 7)  # 2.0
    assert m[p + "tis_truncated_fraction"] == pytest.approx(1 / 7)
    assert m[p + "token_keep_fraction"] == pytest.approx(2 / 7)
    # raw (pre-truncation, pre-rejection) diagnostics
    xs = [1.0, 1.2, 0.4, 2.0, 1.0, 0.8, 5e-5]
    assert m[p + "xi_min"] == pytest.approx(5e-5)
    assert m[p + "xi_max"] == pytest.approx(2.0)
    assert m[p + "xi_mean"] == pytest.approx(sum(xs) / 7)
    assert m[p + "kl"] == pytest.approx(-sum(math.log(x) for x in xs) / 7)
    assert m[p + "k3_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in xs) / 7)
    assert m[p + "chi2_token"] == pytest.approx(sum(x * x for x in xs) / 7 - 1)
    mean_x = sum(xs) / 7
    assert m[p + "ess"] == pytest.approx(1 / (sum((x / mean_x) ** 2 for x in xs) / 7))
    # per-sequence perplexities: pi_sparse = e^-1 per token, pi_old = e^-1 * xi
    lo0 = sum(math.log(x) for x in xs[:4]) / 4
    lo1 = sum(math.log(x) for x in xs[4:]) / 3
    assert m[p + "rollout_ppl"] == pytest.approx(math.e)
    assert m[p + "training_ppl"] == pytest.approx((math.exp(1 - lo0) + math.exp(1 - lo1)) / 2)
    assert m[p + "log_ppl_abs_diff"] == pytest.approx((abs(lo0) + abs(lo1)) / 2)
    assert m[p + "ppl_ratio"] == pytest.approx((math.exp(-lo0) + math.exp(-lo1)) / 2)
    assert all(isinstance(v, float) for v in m.values())


def test_mode_none_changes_nothing_but_still_measures():
    old, samp, mask = make(XI, MASK)
    w, keep, m = correction_weights(old, samp, mask, algo_config("naive-sparse"))
    assert torch.equal(keep, mask)
    assert torch.equal(w, mask.to(D))
    assert m["rollout_corr/xi_min"] == pytest.approx(5e-5)
    assert m["rollout_corr/seq_rejection_rate"] == 0.0
    assert m["rollout_corr/batch_norm_factor"] == 1.0


def test_a_single_token_rejects_its_sequence_by_veto():
    old, samp, mask = make([[1.0] * 6, [1.0, 1.0, 9e-5, 1.0, 1.0, 1.0]], [[1] * 6, [1] * 6])
    w, keep, m = correction_weights(old, samp, mask, dec(veto_threshold=1e-4))
    assert keep[0].all() and not keep[1].any()
    assert w[1].abs().sum() == 0
    assert m["rollout_corr/seq_rejection_rate"] == 0.5
    # just above the threshold is kept
    old, samp, mask = make([[1.0, 1.1e-4]], [[1, 1]])
    assert correction_weights(old, samp, mask, dec(veto_threshold=1e-4))[1].all()


def test_veto_uses_the_raw_ratio_and_ignores_padding():
    # log xi = -30 is below the +-20 clamp: still vetoed; a tiny xi at a padding position is ignored
    old = torch.tensor([[-31.0, -1.0], [-1.0, -50.0]], dtype=D)
    samp = torch.full_like(old, -1.0)
    mask = torch.tensor([[1, 1], [1, 0]])
    _, keep, m = correction_weights(old, samp, mask, dec(veto_threshold=1e-4))
    assert keep.tolist() == [[False, False], [True, False]]
    assert m["rollout_corr/log_xi_min"] == pytest.approx(-30.0)  # reported before the clamp


def test_token_rejection_bounds_are_inclusive():
    old, samp, mask = make([[0.5, 1.5, 0.49, 1.51]], [[1, 1, 1, 1]], base=0.0)
    _, keep, _ = correction_weights(old, samp, mask, dec(token_rs_low=0.5, token_rs_high=1.5))
    assert keep.tolist() == [[True, True, False, False]]


def test_token_tis_truncates_without_lower_clip():
    old, samp, mask = make([[0.1, 1.0, 3.0]], [[1, 1, 1]])
    w, keep, m = correction_weights(old, samp, mask, dec(tis_cap=2.0))
    torch.testing.assert_close(w, torch.tensor([[0.1, 1.0, 2.0]], dtype=D))
    assert keep.all()
    assert m["rollout_corr/tis_truncated_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_corr/xi_max"] == pytest.approx(3.0)  # before truncation
    assert m["rollout_corr/weight_max"] == pytest.approx(2.0)  # after


def test_batch_norm_gives_mean_one_without_rejection():
    old, samp, mask = make([[0.5, 1.0, 3.0], [0.8, 0.9, 1.0]], [[1, 1, 1], [1, 1, 0]])
    w, _, m = correction_weights(old, samp, mask, dec(tis_cap=1.5, tis_batch_norm=True))
    assert float(w[mask].mean()) == pytest.approx(1.0)
    assert m["rollout_corr/batch_norm_factor"] == pytest.approx((0.5 + 1 + 1.5 + 0.8 + 0.9) / 5)


def test_batch_norm_is_skipped_for_a_vanishing_mean():
    old, samp, mask = make([[1e-9, 1e-9]], [[1, 1]])
    w, _, m = correction_weights(old, samp, mask, dec(tis_cap=1.5, tis_batch_norm=True))
    assert m["rollout_corr/batch_norm_factor"] == 1.0
    torch.testing.assert_close(w, torch.full((1, 2), 1e-9, dtype=D))


def test_icepop_keeps_untruncated_xi_inside_bounds():
    old, samp, mask = make([[0.4, 0.5, 4.0, 5.5]], [[1, 1, 1, 1]], base=0.0)
    w, keep, m = correction_weights(old, samp, mask, dec(icepop_low=0.5, icepop_high=5.0))
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 4.0, 0.0]], dtype=D))
    assert keep.tolist() == [[False, True, True, False]]
    assert m["rollout_corr/icepop_masked_fraction_low"] == 0.25
    assert m["rollout_corr/icepop_masked_fraction_high"] == 0.25


def test_seq_mis_weights_by_the_product_and_rejects_outside():
    # products: 1.2*1.5 = 1.8 (kept, weight 1.8); 0.5*0.5 = 0.25 (rejected)
    old, samp, mask = make([[1.2, 1.5], [0.5, 0.5]], [[1, 1], [1, 1]])
    w, keep, m = correction_weights(old, samp, mask, dec(seq_mis_low=0.5, seq_mis_high=2.0))
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8], [0.0, 0.0]], dtype=D))
    assert keep.tolist() == [[True, True], [False, False]]
    assert m["rollout_corr/seq_mis_rejected_fraction"] == 0.5


def test_geo_rs_uses_the_geometric_mean():
    # seq 0: geometric mean of (4, 0.25) = 1 -> kept although its product-free tokens are extreme;
    # seq 1: geometric mean of (2, 2) = 2 -> rejected at high 1.5
    old, samp, mask = make([[4.0, 0.25], [2.0, 2.0]], [[1, 1], [1, 1]])
    _, keep, m = correction_weights(old, samp, mask, dec(geo_rs_low=0.5, geo_rs_high=1.5))
    assert keep.tolist() == [[True, True], [False, False]]
    assert m["rollout_corr/geo_rs_rejected_fraction"] == 0.5


def test_k3_rs_rejects_on_mean_k3():
    # k3(x) = x - 1 - log x: k3(1) = 0; k3(1.2) = 0.01768; mean over seq 1 = 0.00884 -> kept at 0.01;
    # seq 2 (1.2, 1.2) -> 0.01768 -> rejected
    old, samp, mask = make([[1.0, 1.0], [1.0, 1.2], [1.2, 1.2]], [[1, 1]] * 3)
    _, keep, m = correction_weights(old, samp, mask, dec(k3_rs_threshold=0.01))
    assert keep.any(dim=1).tolist() == [True, True, False]
    assert m["rollout_corr/k3_rs_rejected_fraction"] == pytest.approx(1 / 3)


def test_prob_diff_mask_is_sign_aware():
    p_old = torch.tensor([[0.9, 0.5, 0.2, 0.5]], dtype=D)
    p_samp = torch.tensor([[0.5, 0.5, 0.6, 0.45]], dtype=D)  # diffs +0.4, 0, -0.4, +0.05
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = dec(prob_diff_threshold=0.2)
    _, keep_pos, _ = correction_weights(p_old.log(), p_samp.log(), mask, cfg, advantages=torch.tensor([1.0]))
    _, keep_neg, m = correction_weights(p_old.log(), p_samp.log(), mask, cfg, advantages=torch.tensor([-1.0]))
    assert keep_pos.tolist() == [[False, True, True, True]]
    assert keep_neg.tolist() == [[True, True, False, True]]
    assert m["rollout_corr/prob_diff_masked_fraction"] == 0.25
    adv_tok = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    _, keep_tok, _ = correction_weights(p_old.log(), p_samp.log(), mask, cfg, advantages=adv_tok)
    assert keep_tok.tolist() == [[False, True, False, True]]
    with pytest.raises(ValueError, match="needs `advantages`"):
        correction_weights(p_old.log(), p_samp.log(), mask, cfg)


def test_xi_overflow_stays_finite():
    old = torch.tensor([[0.0, -1.0, -1.0]])
    samp = torch.tensor([[-1000.0, -1.0, -1.0]])  # log xi = 1000: exp would overflow
    mask = torch.ones(1, 3, dtype=torch.bool)
    for name in PRESETS:
        w, _, m = correction_weights(old, samp, mask, algo_config(name))
        assert torch.isfinite(w).all(), name
        assert all(math.isfinite(v) for k, v in m.items() if k != "rollout_corr/kl"), name
    _, _, m = correction_weights(old, samp, mask, algo_config("sparse-rl"))
    assert m["rollout_corr/xi_max"] == pytest.approx(math.exp(20), rel=1e-5)  # the definition's clamp
    assert m["rollout_corr/log_xi_max"] == pytest.approx(1000.0)  # the raw value, not hidden
    assert m["rollout_corr/token_rs_masked_fraction_high"] == pytest.approx(1 / 3)


def test_a_token_the_dense_policy_finds_impossible_is_vetoed():
    old = torch.tensor([[float("-inf"), -1.0], [-1.0, -1.0]])
    samp = torch.full((2, 2), -1.0)
    w, keep, m = correction_weights(old, samp, torch.ones(2, 2), algo_config("sparse-rl"))
    assert keep.tolist() == [[False, False], [True, True]]
    assert torch.isfinite(w).all()
    assert m["rollout_corr/log_xi_min"] == float("-inf")


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_token_masked(preset):
    old, samp = torch.randn(3, 5), torch.randn(3, 5)
    w, keep, m = correction_weights(old, samp, torch.zeros(3, 5), algo_config(preset))
    assert not keep.any() and torch.equal(w, torch.zeros(3, 5))
    assert all(math.isfinite(v) for v in m.values())
    assert m["rollout_corr/response_tokens"] == 0.0


def test_empty_completions_are_not_counted_as_rejected():
    old, samp, mask = make([[1.0, 1.0], [1.0, 1.0]], [[1, 1], [0, 0]])
    w, keep, m = correction_weights(old, samp, mask, algo_config("sparse-rl"))
    assert keep.tolist() == [[True, True], [False, False]]
    assert m["rollout_corr/seq_rejection_rate"] == 0.0
    assert m["rollout_corr/training_ppl"] == pytest.approx(math.e)


def test_garbage_at_padding_is_ignored():
    old, samp, mask = make(XI, MASK)
    cfg = algo_config("sparse-rl")
    ref = correction_weights(old, samp, mask, cfg)
    old2, samp2 = old.clone(), samp.clone()
    old2[1, 3], samp2[1, 3] = float("nan"), float("inf")
    got = correction_weights(old2, samp2, mask, cfg)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]) and ref[2] == got[2]


def test_bad_input_is_named():
    cfg = algo_config("sparse-rl")
    with pytest.raises(ValueError, match="logp_sampler has shape"):
        correction_weights(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), cfg)
    with pytest.raises(ValueError, match=r"mask has shape"):
        correction_weights(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4), cfg)
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        correction_weights(torch.zeros(3), torch.zeros(3), torch.ones(3), cfg)
    samp = torch.zeros(2, 3)
    samp[1, 2] = float("-inf")
    with pytest.raises(ValueError, match=r"seq 1, pos 2"):
        correction_weights(torch.zeros(2, 3), samp, torch.ones(2, 3), cfg)


def test_ppo_anchor():
    a, b = torch.zeros(1, 2), torch.ones(1, 2)
    assert ppo_anchor(a, b, algo_config("sparse-rl")) is a
    assert ppo_anchor(None, b, algo_config("sparse-rl", correction_mode="bypass")) is b
    with pytest.raises(ValueError, match="recomputed"):
        ppo_anchor(None, b, algo_config("sparse-rl"))


def test_weights_are_detached():
    old = torch.randn(2, 3, requires_grad=True)
    w, _, _ = correction_weights(old, torch.randn(2, 3), torch.ones(2, 3), algo_config("tis"))
    assert not w.requires_grad


CONFIGS = [algo_config(p) for p in PRESETS] + [
    dec(seq_mis_low=0.5, seq_mis_high=2.0, tis_cap=2.0, tis_batch_norm=True),
    dec(k3_rs_threshold=0.01, prob_diff_threshold=0.2, icepop_low=0.5, icepop_high=5.0),
]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
    st.sampled_from(range(len(CONFIGS))),
    st.floats(0.01, 30.0),
)
def test_weights_never_negative_and_zero_off_the_keep_mask(b, t, seed, ci, scale):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * scale
    samp = -torch.rand(b, t, generator=g) * scale
    mask = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randn(b, generator=g)
    w, keep, m = correction_weights(old, samp, mask, CONFIGS[ci], advantages=adv)
    assert (w >= 0).all() and torch.isfinite(w).all()
    assert not (keep & ~mask).any()  # never keeps a token outside the response
    assert (w[~keep] == 0).all()
    assert all(not math.isnan(v) for v in m.values())
