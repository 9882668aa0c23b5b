"""GRPO / Dr. GRPO / RLOO advantages against hand-computed values and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl.algo import AlgoConfig, advantages, advantages_from_config, grpo_advantages


def test_grpo_hand_computed():
    # group [1,0,0,0]: mean 0.25, unbiased std sqrt(0.75/3) = 0.5
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_grpo_uses_eps_and_biased_std_on_request():
    r = torch.tensor([2.0, 0.0])
    # unbiased std = sqrt(2), biased std = 1
    torch.testing.assert_close(
        grpo_advantages(r, 2, eps=1e-6), torch.tensor([1.0, -1.0]) / (math.sqrt(2) + 1e-6)
    )
    torch.testing.assert_close(grpo_advantages(r, 2, eps=0.0, std_unbiased=False), torch.tensor([1.0, -1.0]))


def test_drgrpo_has_no_std_normalisation():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 0.0, 0.0]), 4, estimator="drgrpo")
    torch.testing.assert_close(adv, torch.tensor([2.0, 0.0, -1.0, -1.0]))


def test_rloo_is_leave_one_out():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 6.0, 8.0])
    adv = grpo_advantages(r, 4, estimator="rloo")
    expect = []
    for g in r.view(2, 4):
        for i in range(4):
            others = torch.cat([g[:i], g[i + 1 :]])
            expect.append(g[i] - others.mean())
    torch.testing.assert_close(adv, torch.stack(expect))
    torch.testing.assert_close(adv[:4], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_equal_rewards_give_zero_advantage_and_no_nan(estimator):
    r = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    adv = grpo_advantages(r, 4, estimator=estimator)
    assert torch.isfinite(adv).all()
    assert torch.equal(adv, torch.zeros(8))


def test_groups_are_contiguous_and_independent():
    r = torch.tensor([1.0, 0.0, 5.0, 5.0])
    adv = grpo_advantages(r, 2, eps=0.0)
    assert adv[2] == 0 and adv[3] == 0
    assert adv[0] > 0 > adv[1]


def test_a_brorl_group_of_256_beside_a_small_one_in_any_order():
    """BroRL-scale groups: 256 samples of one prompt and 3 of another, shuffled together; each sample gets its
    own group's (R - mean) / (unbiased std + eps), computed by hand."""
    g = torch.Generator().manual_seed(0)
    big = (torch.rand(256, generator=g, dtype=torch.float64) < 0.3).double()
    small = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    expect = torch.cat([(x - x.mean()) / (x.std() + 1e-6) for x in (big, small)])
    index = torch.tensor([7] * 256 + [2] * 3)
    perm = torch.randperm(259, generator=g)
    adv = advantages(torch.cat([big, small])[perm], index[perm])
    torch.testing.assert_close(adv, expect[perm])
    assert abs(float(adv[index[perm] == 7].sum())) < 1e-9  # a group's advantages sum to zero


def test_group_of_one_gets_zero():
    assert torch.equal(grpo_advantages(torch.tensor([1.0, 0.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="rloo"):
        grpo_advantages(torch.tensor([1.0, 0.0]), 1, estimator="rloo")


def test_empty_batch():
    assert grpo_advantages(torch.zeros(0), 4).numel() == 0


@pytest.mark.parametrize(
    "rewards, group, estimator, match",
    [
        (torch.zeros(6), 4, "grpo", "divide"),
        (torch.zeros(2, 4), 4, "grpo", "1-D"),
        (torch.zeros(4), 4, "gae", "unknown"),
        (torch.tensor([0.0, float("nan"), 1.0, 0.0]), 4, "grpo", r"not finite at sequence index\(es\) \[1\]"),
    ],
)
def test_bad_input_is_named(rewards, group, estimator, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group, estimator=estimator)


def test_from_config():
    cfg = AlgoConfig(adv_estimator="drgrpo")
    torch.testing.assert_close(
        advantages_from_config(torch.tensor([1.0, 0.0]), [7, 7], cfg), torch.tensor([0.5, -0.5])
    )


def test_batch_whiten_transform_follows_the_estimator():
    """REINFORCE++-baseline: the group-mean baseline (drgrpo), then whitening over the batch."""
    cfg = AlgoConfig(adv_estimator="drgrpo", adv_transforms=["batch_whiten"], adv_eps=0.0)
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    adv = advantages_from_config(r, [0, 0, 1, 1], cfg)
    raw = torch.tensor([0.5, -0.5, 1.0, -1.0])
    torch.testing.assert_close(adv, (raw - raw.mean()) / raw.std())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=8),
    st.sampled_from(["grpo", "drgrpo", "rloo"]),
)
def test_group_advantages_sum_to_zero(values, estimator):
    adv = grpo_advantages(torch.tensor(values, dtype=torch.float64), len(values), estimator=estimator)
    assert torch.isfinite(adv).all()
    assert abs(float(adv.sum())) < 1e-6 * max(1.0, float(adv.abs().sum()))


def test_equal_non_round_rewards_are_exactly_zero():
    adv = grpo_advantages(torch.full((8,), 0.1), 8)
    assert torch.equal(adv, torch.zeros(8))
