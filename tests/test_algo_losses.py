"""GSPO, CISPO, REINFORCE++, sequence TIS and verl's rejection names, each against its formula on hand-made
tensors (the formulas are written out here in scalars, not taken from the library)."""

from __future__ import annotations

import math
from dataclasses import asdict, fields

import pytest
import torch

from sparserl.algo import (
    POLICY_LOSSES,
    AlgoConfig,
    advantages,
    advantages_from_config,
    algo_config,
    correction_weights,
    policy_loss,
    register_policy_loss,
    rollout_rs_overrides,
)
from sparserl.algo.losses import ppo_clip

NOKL = {"kl_coef": 0.0}
DEC = {"correction_mode": "decoupled"}


def _seq_batch():
    """Two sequences, the second of two tokens: log pi_theta (leaf), log pi_old, mask."""
    lp = torch.tensor([[-0.5, -1.0, -0.2], [-0.3, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.6, -0.9, -0.4], [-0.1, -2.3, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return lp, old, mask


# ---- GSPO ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adv", [(1.0, -1.0), (-2.0, 0.5), (1.0, 1.0)])
def test_gspo_is_the_sequence_level_clipped_objective(adv):
    """loss = (1/B) sum_i max(-A_i s_i, -A_i clip(s_i, 1-eps, 1+eps)), s_i = exp(mean_t (lp - old)); value and
    gradient equal those of this sequence-level formula, autograd'ed directly."""
    cfg = AlgoConfig(policy_loss="gspo", eps_low=0.05, eps_high=0.08, **NOKL)
    lp, old, mask = _seq_batch()
    a = torch.tensor(adv, dtype=torch.float64)
    loss, m = policy_loss(lp, old, a, mask, None, cfg)
    loss.backward()

    lp2 = lp.detach().clone().requires_grad_(True)
    terms = []
    for i, n in enumerate((3, 2)):
        s = torch.exp((lp2[i, :n] - old[i, :n]).sum() / n)
        terms.append(torch.maximum(-a[i] * s, -a[i] * s.clamp(1 - 0.05, 1 + 0.08)))
    expected = sum(terms) / 2
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(lp.grad, lp2.grad, rtol=1e-10, atol=1e-14)
    assert lp.grad[1, 2] == 0  # padding


def test_gspo_clips_whole_sequences():
    cfg = AlgoConfig(policy_loss="gspo", eps_low=0.05, eps_high=0.08, **NOKL)
    lp, old, mask = _seq_batch()
    s = [math.exp((0.1 - 0.1 + 0.2) / 3), math.exp((-0.2 + 0.3) / 2)]  # 1.069 (inside), 1.051 (inside)
    _, m = policy_loss(lp, old, torch.tensor([1.0, 1.0]), mask, None, cfg)
    assert m["actor/ratio_max"] == pytest.approx(max(s)) and m["actor/pg_clipfrac"] == 0.0
    tight = AlgoConfig(policy_loss="gspo", eps_low=0.01, eps_high=0.06, **NOKL)
    lp.grad = None
    loss, m = policy_loss(lp, old, torch.tensor([1.0, 1.0]), mask, None, tight)
    loss.backward()
    assert m["actor/pg_clipfrac"] == pytest.approx(3 / 5)  # every kept token of sequence 0, none of 1
    assert torch.all(lp.grad[0] == 0) and torch.all(lp.grad[1, :2] != 0)


def test_gspo_ratio_is_one_on_policy_and_matches_ppo_there():
    """On-policy (pi_theta = pi_old) GSPO's gradient is (1/B) sum_i -A_i mean_t grad log pi: the PPO one under
    seq-mean-token-mean."""
    lp, _, mask = _seq_batch()
    a = torch.tensor([1.5, -0.5], dtype=torch.float64)
    g = []
    for name in ("gspo", "ppo_clip"):
        x = lp.detach().clone().requires_grad_(True)
        loss, _ = policy_loss(x, x.detach(), a, mask, None, AlgoConfig(policy_loss=name, **NOKL))
        loss.backward()
        g.append(x.grad)
    assert torch.allclose(g[0], g[1], rtol=1e-12)


# ---- CISPO ---------------------------------------------------------------------------------------------------


def test_cispo_value_and_gradient_through_every_token():
    """loss = (1/B) sum_i (1/|y_i|) sum_t -clip(r_t, 1-eps_low, 1+eps_high) A_i lp_t with the clip detached:
    d loss / d lp_t = -(1/B)(1/|y_i|) clip(r_t) A_i, non-zero where PPO's clip zeroes it."""
    cfg = AlgoConfig(policy_loss="cispo", eps_low=0.1, eps_high=0.1, **NOKL)
    lp, old, mask = _seq_batch()
    a = [2.0, -1.0]
    loss, m = policy_loss(lp, old, torch.tensor(a, dtype=torch.float64), mask, None, cfg)
    loss.backward()
    value, grad, n_clipped = 0.0, torch.zeros(2, 3, dtype=torch.float64), 0
    for i, n in enumerate((3, 2)):
        for t in range(n):
            r = math.exp(lp[i, t].item() - old[i, t].item())
            w = min(max(r, 0.9), 1.1)
            n_clipped += w != r
            value += -w * a[i] * lp[i, t].item() / n / 2
            grad[i, t] = -w * a[i] / n / 2
    assert loss.item() == pytest.approx(value, rel=1e-12)
    assert torch.allclose(lp.grad, grad, rtol=1e-12)
    assert n_clipped >= 2 and m["actor/pg_clipfrac"] == pytest.approx(n_clipped / 5)
    assert torch.all(lp.grad[mask] != 0)  # PPO's clip would zero the clipped tokens' gradient:
    x = lp.detach().clone().requires_grad_(True)
    ppo, _ = policy_loss(
        x,
        old,
        torch.tensor(a, dtype=torch.float64),
        mask,
        None,
        AlgoConfig(**{**NOKL, "eps_low": 0.1, "eps_high": 0.1}),
    )
    ppo.backward()
    assert int((x.grad[mask] == 0).sum()) >= 1


def test_cispo_takes_the_correction_weights():
    cfg = AlgoConfig(policy_loss="cispo", **NOKL)
    lp, old, mask = _seq_batch()
    a = torch.tensor([1.0, 1.0], dtype=torch.float64)
    w = torch.full((2, 3), 0.5, dtype=torch.float64)
    half, _ = policy_loss(lp, old, a, mask, w, cfg)
    full, _ = policy_loss(lp, old, a, mask, None, cfg)
    assert half.item() == pytest.approx(0.5 * full.item(), rel=1e-12)


# ---- the registry and the config field -------------------------------------------------------------------------


def test_default_loss_is_ppo_clip_and_listed_in_help():
    assert AlgoConfig().policy_loss == "ppo_clip" and POLICY_LOSSES["ppo_clip"] is ppo_clip
    help_text = next(f for f in fields(AlgoConfig) if f.name == "policy_loss").metadata["help"]
    for name in ("ppo_clip", "gspo", "cispo"):
        assert name in POLICY_LOSSES and name in help_text
    with pytest.raises(ValueError, match="algo.policy_loss='nope' is unknown; choose one of ppo_clip, gspo"):
        AlgoConfig(policy_loss="nope")


def test_a_registered_loss_is_called():
    calls = []

    @register_policy_loss("test_half_pg")
    def half(lp, old, adv, m, cfg):
        calls.append(cfg.policy_loss)
        pg, ratio, clipped, dual = ppo_clip(lp, old, adv, m, cfg)
        return 0.5 * pg, ratio, clipped, dual

    try:
        lp, old, mask = _seq_batch()
        a = torch.tensor([1.0, -1.0], dtype=torch.float64)
        mine, _ = policy_loss(lp, old, a, mask, None, AlgoConfig(policy_loss="test_half_pg", **NOKL))
        ref, _ = policy_loss(lp, old, a, mask, None, AlgoConfig(**NOKL))
        assert calls == ["test_half_pg"] and mine.item() == pytest.approx(0.5 * ref.item(), rel=1e-12)
    finally:
        del POLICY_LOSSES["test_half_pg"]


def test_gspo_preset_is_the_papers():
    cfg = algo_config("gspo")
    assert (cfg.policy_loss, cfg.eps_low, cfg.eps_high, cfg.kl_coef) == ("gspo", 3e-4, 4e-4, 0.0)


# ---- REINFORCE++ -----------------------------------------------------------------------------------------------


def _whiten(x):
    mean = sum(x) / len(x)
    std = math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1))
    return [(v - mean) / (std + 1e-6) for v in x]


def test_reinforce_pp_whitens_raw_rewards_over_the_batch():
    rewards = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5]  # group 0 all equal: REINFORCE++ keeps its signal
    group = [0, 0, 0, 1, 1, 1, 2]
    r = torch.tensor(rewards)
    assert advantages(r, group, "reinforce").tolist() == rewards
    got = advantages_from_config(r, group, algo_config("reinforce++"))
    assert got.tolist() == pytest.approx(_whiten(rewards), rel=1e-6)
    assert got[:3].abs().min() > 0.1


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    group = [0, 0, 0, 1, 1, 1]
    centred = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]
    got = advantages_from_config(torch.tensor(rewards), group, algo_config("reinforce++-baseline"))
    assert got.tolist() == pytest.approx(_whiten(centred), rel=1e-6)


# ---- sequence TIS ----------------------------------------------------------------------------------------------


def test_sequence_tis_truncates_the_product_and_rejects_nothing():
    log_xi = torch.tensor([[math.log(0.5), 0.0, math.log(0.8)], [math.log(2.0), math.log(4.0), 0.3]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    samp = torch.full((2, 3), -1.0)
    w, keep, m = correction_weights(samp + log_xi, samp, mask, AlgoConfig(seq_tis_cap=2.0, **DEC))
    assert torch.equal(keep, mask.bool()) and m["rollout_corr/seq_rejection_rate"] == 0.0
    expected = torch.tensor([[0.4, 0.4, 0.4], [2.0, 2.0, 0.0]])  # min(0.5 * 0.8, 2), min(2 * 4, 2)
    assert torch.allclose(w, expected, rtol=1e-6)


# ---- verl's rejection names ------------------------------------------------------------------------------------


def _verl_keep(name: str, spec: str, log_r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's rule, written from its definition: per-token keep mask."""
    x = log_r.double()
    k1, k2, k3 = -x, 0.5 * x**2, torch.expm1(x) - x
    mb = mask.bool()
    n = mask.sum(1).clamp_min(1)
    if name.endswith("k1"):
        lo, hi = (float(x) for x in spec.split("_"))
    if name == "token_k1":
        return (k1 >= math.log(lo)) & (k1 <= math.log(hi)) & mb
    if name == "token_k2":
        return (k2 <= float(spec)) & mb
    if name == "token_k3":
        return (k3 <= float(spec)) & mb
    if name == "seq_mean_k1":
        s = (k1 * mb).sum(1) / n
        return ((s >= math.log(lo)) & (s <= math.log(hi)))[:, None] & mb
    if name == "seq_mean_k3":
        return (((k3 * mb).sum(1) / n) <= float(spec))[:, None] & mb
    raise AssertionError(name)


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("token_k1", "0.6_1.4"),
        ("token_k2", "0.08"),
        ("token_k3", "0.05"),
        ("seq_mean_k1", "0.8_1.1"),
        ("seq_mean_k3", "0.03"),
    ],
)
def test_verl_rejection_alias_keeps_what_verl_keeps(name, spec):
    g = torch.Generator().manual_seed(0)
    log_r = torch.randn(64, 6, generator=g, dtype=torch.float64) * 0.3
    mask = torch.ones(64, 6, dtype=torch.bool)
    mask[::3, 4:] = False
    samp = torch.full_like(log_r, -2.0)
    cfg = AlgoConfig(rollout_rs=[f"{name}:{spec}"], **DEC)
    _, keep, _ = correction_weights(samp + log_r, samp, mask, cfg)
    want = _verl_keep(name, spec, log_r, mask)
    assert 0 < int(want.sum()) < int(mask.sum())  # the rule bites, and not everywhere
    assert torch.equal(keep, want)


def test_token_k3_bounds_solve_k3_equals_t():
    lo, hi = (rollout_rs_overrides(["token_k3:0.5"])[k] for k in ("token_rs_low", "token_rs_high"))
    assert lo < 1 < hi
    for x in (lo, hi):
        assert x - 1 - math.log(x) == pytest.approx(0.5, abs=1e-12)
    k2 = rollout_rs_overrides(["token_k2:2.0"])
    assert (k2["token_rs_low"], k2["token_rs_high"]) == pytest.approx((math.exp(-2.0), math.exp(2.0)))


def test_aliases_and_with_what_is_set_and_expand_idempotently():
    cfg = AlgoConfig(rollout_rs=["token_k2:2.0", "token_k1:0.5_1.25"], token_rs_low=0.9, **DEC)
    assert cfg.token_rs_low == 0.9  # the stricter lower bound stays
    assert cfg.token_rs_high == pytest.approx(2.0)  # token_k1's 1/0.5 beats token_k2's e^2
    again = AlgoConfig(**asdict(cfg))  # a saved config reloads to itself
    assert again == cfg


@pytest.mark.parametrize("name", ["seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2"])
def test_names_without_an_equivalent_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match=f"{name} has no equivalent here"):
        AlgoConfig(rollout_rs=[f"{name}:2.0"], **DEC)


def test_alias_errors_name_the_key():
    with pytest.raises(ValueError, match="unknown verl rejection name 'token_k9'"):
        AlgoConfig(rollout_rs=["token_k9:1.0"], **DEC)
    with pytest.raises(ValueError, match="needs a threshold"):
        AlgoConfig(rollout_rs=["token_k2"], **DEC)
    with pytest.raises(ValueError, match="correction_mode='none' ignores algo.rollout_rs"):
        AlgoConfig(rollout_rs=["token_k2:1.0"])
