"""Policy-gradient surrogates, one pure function per method, selected by `algo.policy_loss`.

Each takes (log pi_theta with grad, the detached PPO anchor log pi_old, advantages [B, T], the bool loss mask,
the AlgoConfig), all [B, T] and already zero off the mask, and returns the per-token loss to minimise (before
IS weights and aggregation), the ratio it used, and where its clip and dual clip acted. `policy_loss`
(algo/loss.py) multiplies by the correction weights, aggregates, and adds KL and entropy, whatever the loss.

- ppo_clip: PPO's clipped surrogate on the token ratio (dual clip on request); the default.
- gspo: GSPO (Zheng et al. 2025): the same surrogate on the length-normalised sequence ratio
  s_i = exp(mean_t (log pi_theta - log pi_old)), clipped per sequence; each token carries s_i's value and
  the gradient s_i * grad log pi_theta(o_t), so seq-mean-token-mean aggregation gives grad s_i exactly.
- cispo: CISPO (MiniMax-M1): -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(o_t); the IS
  weight is clipped and detached, so every token keeps its gradient (PPO zeroes the clipped ones).
- soft_sapo: Soft Adaptive Policy Optimization (TRL's and verl's loss 'sapo'): a smooth gate on r_t instead of
  the clip. Not sparserl's SAPO, the swarm sharing of rollouts (distributed.swarm.*): hence the name.
- clip_cov, kl_cov: Clip-Cov and KL-Cov ("The Entropy Mechanism of RL for Reasoning LMs", verl's names): the
  few tokens of highest covariance of advantage and log-prob lose their gradient, or pay a KL penalty.

Register another with `@register_policy_loss("name")` (verl's policy_loss registry is the model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sparserl.algo.masked import masked_mean, masked_sum
from sparserl.registry import Registry

if TYPE_CHECKING:  # the config validates algo.policy_loss against POLICY_LOSSES
    from sparserl.algo.config import AlgoConfig

# (lp, old, adv, mask, cfg) -> (per-token loss, ratio, clipped, dual-clipped), all [B, T]
PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, "AlgoConfig"], tuple[Tensor, Tensor, Tensor, Tensor]]

POLICY_LOSSES: Registry[Any] = Registry("algo.policy_loss")
register_policy_loss = POLICY_LOSSES.register  # function decorator: `algo.policy_loss=name`
# Other spellings accepted as algo.policy_loss (AlgoConfig stores the registered name), and names refused
POLICY_LOSS_ALIASES = {"sapo_loss": "soft_sapo"}
REFUSED_POLICY_LOSSES = {
    "sapo": "TRL and verl call Soft Adaptive Policy Optimization 'sapo', but SAPO here is the swarm sharing "
    "of rollouts (distributed.swarm.*, docs/distributed.md), not a loss: the soft-gated loss is "
    "algo.policy_loss=soft_sapo (or sapo_loss)",
}


def token_ratio(lp: Tensor, old: Tensor, cfg: AlgoConfig) -> Tensor:
    """r_t = exp(clamp(log pi_theta - log pi_old, +-cfg.log_ratio_clamp))."""
    c = cfg.log_ratio_clamp
    return (lp - old).clamp(-c, c).exp()


def surrogate(
    ratio: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A), capped at -c A for A < 0
    (dual clip); returns it, the ratio, and where the clip and the dual clip acted (on `m`)."""
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)
    clipped = m & (loss_clipped > loss_unclipped)
    dual = torch.zeros_like(m)
    if cfg.dual_clip_c is not None:
        cap = -adv * cfg.dual_clip_c
        dual = m & (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    return pg, ratio, clipped, dual


@register_policy_loss("ppo_clip")
def ppo_clip(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PPO: the surrogate on the token ratio r_t."""
    return surrogate(token_ratio(lp, old, cfg), adv, m, cfg)


@register_policy_loss("gspo")
def gspo(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """GSPO: the surrogate on s_i = exp(mean_t log(pi_theta / pi_old)) over the sequence's kept tokens.

    Per token, log s_it = sg(log s_i) + log pi_theta(o_t) - sg(log pi_theta(o_t)): the value of s_i, the
    gradient s_i * grad log pi_theta(o_t) (GSPO-token with a sequence advantage is GSPO)."""
    c = cfg.log_ratio_clamp
    n = m.sum(dim=1, keepdim=True).clamp_min(1).to(lp.dtype)
    log_s = (masked_sum(lp - old, m, dim=1)[:, None] / n).detach()
    log_s_tok = (lp - lp.detach() + log_s).clamp(-c, c)
    return surrogate(torch.where(m, log_s_tok, torch.zeros_like(log_s_tok)).exp(), adv, m, cfg)


gspo.sequence_level = True  # type: ignore[attr-defined]  # one ratio a sequence: the config warns of token-mean


@register_policy_loss("cispo")
def cispo(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CISPO: -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi_theta(o_t); `clipped` marks the tokens
    whose IS weight the clip changed (they still get a gradient); no dual clip."""
    ratio = token_ratio(lp, old, cfg)
    weight = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high).detach()
    pg = -weight * adv * lp
    clipped = m & (weight != ratio.detach())
    return pg, ratio, clipped, torch.zeros_like(m)


@register_policy_loss("soft_sapo")
def soft_sapo(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Soft Adaptive Policy Optimization (Qwen, arXiv 2511.20347): -f(r_t) A with the gate
    f(r) = (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos where A > 0, else tau_neg. Its gradient,
    4 sigmoid(1 - sigmoid) r A grad log pi, is PPO's at r = 1 and fades smoothly off-policy: nothing is clipped."""
    ratio = token_ratio(lp, old, cfg)
    tau = torch.full_like(adv, cfg.tau_neg).masked_fill(adv > 0, cfg.tau_pos)
    none = torch.zeros_like(m)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv, ratio, none, none


def token_cov(lp: Tensor, adv: Tensor, m: Tensor) -> Tensor:
    """Each token's term of the covariance of advantage and log-prob over the loss mask,
    (A - mean A)(log pi - mean log pi), detached (Clip-Cov and KL-Cov pick tokens by it)."""
    lp = lp.detach()
    return (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))


def _at(m: Tensor, flat_index: Tensor) -> Tensor:
    """A bool tensor shaped like `m`, True at the flat positions `flat_index`."""
    return (
        torch.zeros(m.numel(), dtype=torch.bool, device=m.device).index_fill(0, flat_index, True).view_as(m)
    )


@register_policy_loss("clip_cov")
def clip_cov(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Clip-Cov: PPO's surrogate, then loss and gradient 0 at max(1, int(clip_cov_ratio x n)) tokens drawn at
    random (torch's global generator, as verl) among those the PPO clip left whose covariance is inside
    (clip_cov_lb, clip_cov_ub); `clipped` marks both kinds of token without gradient."""
    pg, ratio, clipped, dual = surrogate(token_ratio(lp, old, cfg), adv, m, cfg)
    cov = token_cov(lp, adv, m)
    candidates = (m & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)).flatten().nonzero()[:, 0]
    n = max(int(cfg.clip_cov_ratio * int(m.sum())), 1)
    cut = _at(m, candidates[torch.randperm(candidates.numel(), device=m.device)[:n]])
    return torch.where(cut, torch.zeros_like(pg), pg), ratio, clipped | cut, dual


@register_policy_loss("kl_cov")
def kl_cov(
    lp: Tensor, old: Tensor, adv: Tensor, m: Tensor, cfg: AlgoConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """KL-Cov: -r_t A, no clip, plus ppo_kl_coef |log r_t| at the max(1, int(kl_cov_ratio x n))
    tokens of largest covariance, those of them above 0 (verl takes the top k whatever their sign: the same
    unless fewer than k are positive; here a batch without covariance, e.g. all A = 0, pays nothing).
    `clipped` marks the penalised tokens."""
    log_r = (lp - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)  # token_ratio's, so |log r| is finite
    cov = torch.where(m, token_cov(lp, adv, m), torch.full_like(lp, float("-inf")))
    k = min(max(int(cfg.kl_cov_ratio * int(m.sum())), 1), m.numel())
    picked = _at(m, cov.flatten().topk(k).indices) & (cov > 0)
    pg = -adv * log_r.exp() + cfg.ppo_kl_coef * log_r.abs() * picked
    return pg, log_r.exp(), picked, torch.zeros_like(m)
