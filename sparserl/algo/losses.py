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

Register another with `@register_policy_loss("name")` (verl's policy_loss registry is the model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sparserl.algo.masked import masked_sum
from sparserl.registry import Registry

if TYPE_CHECKING:  # the config validates algo.policy_loss against POLICY_LOSSES
    from sparserl.algo.config import AlgoConfig

# (lp, old, adv, mask, cfg) -> (per-token loss, ratio, clipped, dual-clipped), all [B, T]
PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, "AlgoConfig"], tuple[Tensor, Tensor, Tensor, Tensor]]

POLICY_LOSSES: Registry[Any] = Registry("algo.policy_loss")
register_policy_loss = POLICY_LOSSES.register  # function decorator: `algo.policy_loss=name`


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
