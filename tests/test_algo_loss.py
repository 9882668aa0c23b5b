"""policy_loss: hand-computed PPO terms, aggregation modes, KL, entropy, a gradient check, masking properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl.algo import AlgoConfig, aggregate, algo_config, kl_penalty, loss_denominator, policy_loss

D = torch.float64
NOKL = {"kl_coef": 0.0}


def ratios_to_logps(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.tensor(ratios, dtype=D)
    old = torch.full_like(r, -1.0)
    return (old + r.log()).requires_grad_(), old


def test_ppo_clip_hand_computed_positive_advantage():
    logp, old = ratios_to_logps([[1.1, 1.5, 0.5]])
    w = torch.tensor([[1.0, 2.0, 0.5]], dtype=D)
    loss, m = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), w, AlgoConfig(**NOKL))
    # max(-r, -clip(r, 0.8, 1.2)) = [-1.1, -1.2, -0.5]; times w = [-1.1, -2.4, -0.25]; token mean
    assert loss.item() == pytest.approx(-3.75 / 3)
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3)
    assert m["actor/pg_loss"] == pytest.approx(-1.25)
    assert m["actor/ppo_kl"] == pytest.approx(-(math.log(1.1) + math.log(1.5) + math.log(0.5)) / 3)


def test_ppo_clip_hand_computed_negative_advantage():
    logp, old = ratios_to_logps([[1.1, 1.5, 0.5]])
    loss, m = policy_loss(logp, old, torch.tensor([-2.0]), torch.ones(1, 3), None, AlgoConfig(**NOKL))
    # max(2r, 2 clip(r)) = [2.2, 3.0, 1.6]
    assert loss.item() == pytest.approx((2.2 + 3.0 + 1.6) / 3)
    assert m["actor/pg_clipfrac"] == pytest.approx(1 / 3)


def test_clip_higher():
    logp, old = ratios_to_logps([[1.25]])
    sym, _ = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), None, AlgoConfig(**NOKL))
    high, _ = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 1), None, AlgoConfig(eps_high=0.28, **NOKL)
    )
    assert sym.item() == pytest.approx(-1.2)
    assert high.item() == pytest.approx(-1.25)


def test_dual_clip_caps_negative_advantage_loss():
    logp, old = ratios_to_logps([[5.0, 2.0]])
    cfg = AlgoConfig(dual_clip_c=3.0, **NOKL)
    loss, m = policy_loss(logp, old, torch.tensor([-1.0]), torch.ones(1, 2), None, cfg)
    # token 0: max(5, 1.2) = 5 capped at 3; token 1: max(2, 1.2) = 2 < 3
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    assert m["actor/pg_clipfrac_lower"] == 0.5
    pos, _ = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), None, cfg)
    assert pos.item() == pytest.approx((-1.2 - 1.2) / 2)  # dual clip never acts on A > 0


X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0], [7.0, 7.0, 0.0, 0.0]], dtype=D)
M = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # row 2 rejected
R = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)  # before rejection


@pytest.mark.parametrize(
    "mode, counted, norm, expect",
    [
        ("seq-mean-token-mean", True, None, (2.0 + 10.0) / 3),
        ("seq-mean-token-mean", False, None, (2.0 + 10.0) / 2),
        ("token-mean", True, None, 16.0 / 6),  # rejected row's 2 tokens count (response_mask given)
        ("token-mean", False, None, 16.0 / 4),
        ("seq-mean-token-sum-norm", True, None, (6.0 / 4 + 10.0 / 4) / 3),
        ("seq-mean-token-sum-norm", True, 8, (6.0 / 8 + 10.0 / 8) / 3),
        ("seq-mean-token-sum-norm", False, 8, (6.0 / 8 + 10.0 / 8) / 2),
    ],
)
def test_aggregation_modes(mode, counted, norm, expect):
    cfg = AlgoConfig(loss_agg_mode=mode, rejected_in_denominator=counted, loss_token_norm=norm)
    assert float(aggregate(X, M, cfg, response_mask=R)) == pytest.approx(expect)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_add_up_to_the_global_loss(mode):
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(6, 5, generator=g, dtype=D), torch.randn(6, 5, generator=g, dtype=D)
    adv, mask = torch.randn(6, generator=g, dtype=D), torch.rand(6, 5, generator=g) < 0.7
    mask[2] = False
    cfg = AlgoConfig(loss_agg_mode=mode, **NOKL)
    full, _ = policy_loss(logp, old, adv, mask, None, cfg)
    d = loss_denominator(mask, cfg)
    parts = [
        policy_loss(logp[s], old[s], adv[s], mask[s], None, cfg, denominator=d)[0]
        for s in (slice(0, 2), slice(2, 6))
    ]
    assert (sum(parts)).item() == pytest.approx(full.item())


def test_reference_formula_rejected_sequence_dilutes():
    """Sparse-RL: L = (1/B) sum_i sum_t m pg / max(1, sum_t m); a rejected sequence adds 0 but counts in B."""
    logp, old = ratios_to_logps([[1.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, 5.0]), mask, None, algo_config("sparse-rl", **NOKL))
    assert loss.item() == pytest.approx(-0.5)


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([-1.0], dtype=D), torch.tensor([-2.0], dtype=D)
    assert float(kl_penalty(lp, ref, "k1", 10.0)) == pytest.approx(1.0)
    assert float(kl_penalty(lp, ref, "k2", 10.0)) == pytest.approx(0.5)
    assert float(kl_penalty(lp, ref, "k3", 10.0)) == pytest.approx(math.exp(-1.0))
    assert (
        float(kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3", 10.0)) == 10.0
    )  # clamped, finite


def test_kl_and_entropy_terms_enter_the_loss():
    logp, old = ratios_to_logps([[1.0, 1.0]])
    ref = old - 1.0  # log pi - log pi_ref = 1 -> k3 = e^-1
    ent = torch.tensor([[2.0, 4.0]], dtype=D)
    cfg = AlgoConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    loss, m = policy_loss(
        logp, old, torch.tensor([1.0]), torch.ones(1, 2), None, cfg, logp_ref=ref, entropy=ent
    )
    assert loss.item() == pytest.approx(-1.0 + 0.1 * math.exp(-1.0) - 0.01 * 3.0)
    assert m["actor/kl_ref"] == pytest.approx(math.exp(-1.0))
    assert m["actor/entropy"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="needs logp_ref"):
        policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), None, cfg)
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), None, cfg, logp_ref=ref)


def test_gradient_matches_the_analytic_expression():
    """d loss / d log pi_theta for seq-mean-token-mean with IS weights, clip, dual clip and k3 KL."""
    g = torch.Generator().manual_seed(1)
    b, t = 3, 5
    old = -torch.rand(b, t, generator=g, dtype=D) * 2
    logp = (old + torch.randn(b, t, generator=g, dtype=D) * 0.4).requires_grad_()
    ref = old + torch.randn(b, t, generator=g, dtype=D) * 0.3
    adv = torch.tensor([1.3, -0.7, -2.0], dtype=D)
    w = torch.rand(b, t, generator=g, dtype=D) * 1.5
    mask = torch.rand(b, t, generator=g) < 0.75
    mask[:, 0] = True
    beta, cfg = 0.05, AlgoConfig(eps_high=0.28, dual_clip_c=1.1, kl_coef=0.05)
    loss, m = policy_loss(logp, old, adv, mask, w, cfg, logp_ref=ref)
    (grad,) = torch.autograd.grad(loss, logp)

    with torch.no_grad():
        r = (logp - old).exp()
        a = adv[:, None].expand(b, t)
        unclipped = -a * r
        clipped = -a * r.clamp(1 - 0.2, 1 + 0.28)
        # the unclipped term is the max (ties: inside the clip range both equal -a*r with the same slope)
        active = unclipped >= clipped
        capped = (a < 0) & (torch.maximum(unclipped, clipped) > -a * 1.1)
        d_pg = torch.where(active & ~capped, w * (-a * r), torch.zeros_like(r))
        d_kl = beta * (1.0 - (ref - logp).exp())
        n = mask.sum(dim=1, keepdim=True).to(D)
        expect = torch.where(mask, (d_pg + d_kl) / (n * b), torch.zeros_like(r))
    assert capped.any() and (~active).any() and (active & ~capped & mask).any()  # every branch is exercised
    torch.testing.assert_close(grad, expect, rtol=1e-10, atol=1e-12)


def test_every_token_masked_gives_zero_loss_and_zero_gradient():
    logp = torch.randn(2, 3, requires_grad=True)
    for cfg in (
        AlgoConfig(),
        AlgoConfig(loss_agg_mode="token-mean"),
        AlgoConfig(loss_agg_mode="seq-mean-token-sum-norm"),
    ):
        loss, m = policy_loss(
            logp, torch.randn(2, 3), torch.ones(2), torch.zeros(2, 3), None, cfg, logp_ref=torch.randn(2, 3)
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(2, 3))
        assert all(math.isfinite(v) for v in m.values())


def test_empty_completion_row_contributes_zero():
    logp, old = ratios_to_logps([[1.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask, None, AlgoConfig(**NOKL))
    assert torch.isfinite(loss)


def test_bad_input_is_named():
    cfg = AlgoConfig(**NOKL)
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="logp_old has shape"):
        policy_loss(z, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), None, cfg)
    with pytest.raises(ValueError, match="advantages have shape"):
        policy_loss(z, z, torch.zeros(3), torch.ones(2, 3), None, cfg)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        policy_loss(z, z, torch.zeros(2), torch.ones(2, 3), -torch.ones(2, 3), cfg)


CFGS = [
    AlgoConfig(),
    AlgoConfig(loss_agg_mode="token-mean", dual_clip_c=3.0, kl_estimator="k1"),
    AlgoConfig(loss_agg_mode="seq-mean-token-sum-norm", rejected_in_denominator=False, kl_estimator="k2"),
    AlgoConfig(rejected_in_denominator=False, eps_high=0.28, entropy_coef=0.01),
]
JUNK = st.sampled_from([0.0, 1e6, -1e6, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1), st.sampled_from(range(len(CFGS))), JUNK
)
def test_a_masked_token_never_changes_the_loss(b, t, seed, ci, junk):
    g = torch.Generator().manual_seed(seed)
    cfg = CFGS[ci]
    logp = -torch.rand(b, t, generator=g, dtype=D) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=D) * 0.5
    ref = logp + torch.randn(b, t, generator=g, dtype=D) * 0.5
    adv = torch.randn(b, t, generator=g, dtype=D)
    w = torch.rand(b, t, generator=g, dtype=D) * 2
    ent = torch.rand(b, t, generator=g, dtype=D)
    mask = torch.rand(b, t, generator=g) < 0.6

    def run(lp, *rest):
        lp = lp.clone().requires_grad_()
        loss, m = policy_loss(lp, *rest[:2], mask, rest[2], cfg, logp_ref=rest[3], entropy=rest[4])
        (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
        return loss.detach(), grad, m

    base = run(logp, old, adv, w, ref, ent)
    junked = [x.clone() for x in (logp, old, adv, w, ref, ent)]
    for x in junked:
        x[~mask] = junk if x is not junked[3] else abs(junk)
    got = run(*junked)
    assert torch.equal(base[0], got[0])
    assert base[2] == got[2]
    if got[1] is not None:
        assert torch.equal(got[1][~mask], torch.zeros_like(got[1][~mask]))
        assert torch.isfinite(got[1]).all()
