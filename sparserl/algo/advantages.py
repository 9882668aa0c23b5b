"""Group-relative advantages over group ids (groups of any size), then an ordered chain of transforms.

Two registries, one small function or class per method:
- estimators (`ADV_ESTIMATORS`): one group's rewards -> its advantages (grpo, drgrpo, rloo; reinforce, the raw
  reward, for REINFORCE++);
- transforms (`ADV_TRANSFORMS`): the whole batch's advantages, with its rewards, group ids and texts -> new
  advantages, [B] or token-level [B, T] (uniqueness weights, tree advantages); `algo.adv_transforms` lists
  them in order, none by default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from sparserl.algo.masked import token_mask
from sparserl.registry import Registry

if TYPE_CHECKING:  # the config validates names against the registries below
    from sparserl.algo.config import AlgoConfig

# (group rewards [1, n] float64, eps, std_unbiased) -> advantages [1, n]
Estimator = Callable[[Tensor, float, bool], Tensor]

ADV_ESTIMATORS: Registry[Any] = Registry("algo.adv_estimator")


def register_adv_estimator(
    name: str, *, std_normalised: bool = False, group_baseline: bool = True, min_group: int = 1
) -> Callable[[Estimator], Estimator]:
    """Function decorator: `algo.adv_estimator=name`, with what the estimator is, read by the code that
    depends on it (never its name): `std_normalised` (advantages divided by the group's std: DARS's schedule
    follows it), `group_baseline` (False: the rewards are not group-relative, an equal group keeps them),
    `min_group` (the least group size it is defined on; the config refuses a smaller rollout.n)."""

    def add(fn: Estimator) -> Estimator:
        ADV_ESTIMATORS.register(name)(fn)
        fn.std_normalised, fn.group_baseline, fn.min_group = std_normalised, group_baseline, min_group  # type: ignore[attr-defined]
        return fn

    return add


@register_adv_estimator("grpo", std_normalised=True)
def _grpo(g: Tensor, eps: float, std_unbiased: bool) -> Tensor:
    """Group mean and std: (R_i - mean_G R) / (std_G R + eps), std unbiased (n-1) by default."""
    return (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True, unbiased=std_unbiased) + eps)


@register_adv_estimator("drgrpo")
def _drgrpo(g: Tensor, eps: float, std_unbiased: bool) -> Tensor:
    """Group mean, no std normalisation (Dr GRPO): R_i - mean_G R."""
    return g - g.mean(dim=1, keepdim=True)


@register_adv_estimator("rloo", min_group=2)
def _rloo(g: Tensor, eps: float, std_unbiased: bool) -> Tensor:
    """Leave-one-out mean: R_i - mean_{j != i} R_j, written through the group mean."""
    n = g.shape[1]
    if n < 2:
        raise ValueError("the 'rloo' estimator needs groups of >= 2 samples")
    return (g - g.mean(dim=1, keepdim=True)) * n / (n - 1)


@register_adv_estimator("reinforce", group_baseline=False)
def _reinforce(g: Tensor, eps: float, std_unbiased: bool) -> Tensor:
    """The raw reward R_i, no baseline: REINFORCE++ (Hu 2025) with adv_transforms=[batch_whiten], which then
    subtracts the batch mean. Not group-relative: an equal-reward group or a group of one keeps its rewards."""
    return g.clone()


def advantages(
    rewards: Tensor,
    group_index: Tensor | Sequence[int],
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_unbiased: bool = True,
) -> Tensor:
    """Per-sequence advantages; `group_index[i]` names the group of sequence i (groups of any size, in any
    order). Computed over every sequence of the group, before any rejection. A group of equal rewards, or of
    one sample, gets zero advantage, never NaN (except rloo, which refuses a single sample, and reinforce,
    which has no group baseline: the rewards as they are). Returns shape [num_seqs], float32 (float64 for
    float64 rewards)."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(
            f"advantage estimator {estimator!r} is unknown; choose one of {', '.join(ADV_ESTIMATORS)}"
        )
    fn = ADV_ESTIMATORS[estimator]
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_seqs], got shape {tuple(rewards.shape)}")
    index = torch.as_tensor(group_index, dtype=torch.long)
    if index.shape != rewards.shape:
        raise ValueError(f"group_index has shape {tuple(index.shape)}, rewards {tuple(rewards.shape)}")
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().double()  # a handful of numbers: exact group statistics are free
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise ValueError(f"rewards are not finite at sequence index(es) {bad[:10]}")
    if not fn.group_baseline:
        return fn(r.view(1, -1), eps, std_unbiased).view(-1).to(out_dtype)
    adv = torch.zeros_like(r)
    for gid in torch.unique(index).tolist():
        rows = torch.nonzero(index == gid).flatten()
        g = r[rows].view(1, -1)
        if g.shape[1] < fn.min_group:
            raise ValueError(f"the {estimator!r} estimator needs groups of >= {fn.min_group} samples")
        if g.shape[1] == 1:
            continue  # no baseline within a group of one: zero
        a = fn(g, eps, std_unbiased)
        # A group of equal rewards carries no signal: exactly zero (no 0/0 with eps=0, no float residue).
        adv[rows] = torch.where(g.amax() == g.amin(), torch.zeros_like(a), a).view(-1)
    return adv.to(out_dtype)


def grpo_advantages(
    rewards: Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6, std_unbiased: bool = True
) -> Tensor:
    """`advantages` for contiguous groups of `group_size` completions each."""
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must be >= 1 and divide the number of rewards ({rewards.numel()}); "
            "the completions of one prompt must be contiguous"
        )
    index = torch.arange(rewards.numel()) // group_size
    return advantages(rewards, index, estimator, eps, std_unbiased)


@dataclass
class TransformContext:
    """What a transform is built with, once per run: the `algo` section, the `shaping` section, and the
    trainer's `policy` resources (`.module`, `.tokenizer`, `.engine`, `.autocast()`; None in pure tests)."""

    algo: AlgoConfig
    shaping: Any = None
    policy: Any = None


class AdvantageTransform:
    """One link of `algo.adv_transforms`: `__call__(adv, rewards, group_index, texts)` -> new advantages ([B]
    or [B, T]). Register a subclass with `@register_adv_transform("name")`; it is built once per run with a
    `TransformContext`, and may keep state and `metrics()` (logged under shaping/)."""

    name: ClassVar[str] = ""
    needs_tokens: ClassVar[bool] = False  # True: also called with tokens=[completion ids per sample]
    # True: also called with task_rewards=[B], the task's rewards before shaping (DAPO's overlong penalty)
    needs_task_rewards: ClassVar[bool] = False

    def __init__(self, ctx: TransformContext) -> None:
        self.ctx = ctx

    def __call__(self, adv: Tensor, rewards: Tensor, group_index: Tensor, texts: list[str]) -> Tensor:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        return {}


ADV_TRANSFORMS: Registry[type[AdvantageTransform]] = Registry("algo.adv_transforms")
register_adv_transform = ADV_TRANSFORMS.register  # class decorator: `algo.adv_transforms=[name]`


@register_adv_transform("batch_whiten")
class BatchWhiten(AdvantageTransform):
    """Whiten over the whole batch, (A - mean_B A) / (std_B A + eps): REINFORCE++-baseline's global
    normalisation after a group-mean baseline (algo.adv_estimator=drgrpo). Token-level advantages are
    whitened over the completions' tokens; their padding stays 0."""

    needs_tokens = True  # the completions' lengths: where token-level rows hold a value

    def __call__(
        self, adv: Tensor, rewards: Tensor, group_index: Tensor, texts: list[str], tokens: list | None = None
    ) -> Tensor:
        if adv.dim() == 2 and tokens is None:
            raise ValueError("batch_whiten needs the completions' tokens to leave token-level padding out")
        a = adv.double()
        valid = token_mask(a, [len(t) for t in tokens or []])
        values = a[valid]
        std = values.std() if values.numel() > 1 else torch.zeros((), dtype=a.dtype)
        out = (a - values.mean()) / (std + self.ctx.algo.adv_eps)
        return torch.where(valid, out, torch.zeros_like(out)).to(adv.dtype)


def make_adv_transforms(
    algo: AlgoConfig, shaping: Any = None, policy: Any = None
) -> list[AdvantageTransform]:
    """The run's chain, built once: each of `algo.adv_transforms` in order, then `shaping.method` (when it
    is not 'none')."""
    ctx = TransformContext(algo, shaping, policy)
    names = list(algo.adv_transforms)
    if shaping is not None and shaping.method != "none":
        names.append(shaping.method)
    return [ADV_TRANSFORMS.lookup(name)(ctx) for name in names]


def advantages_from_config(
    rewards: Tensor,
    group_index: Tensor | Sequence[int],
    cfg: AlgoConfig,
    texts: list[str] | None = None,
    transforms: list[AdvantageTransform] | None = None,
    tokens: list[list[int]] | None = None,
    task_rewards: Tensor | None = None,
) -> Tensor:
    """`advantages` with the estimator, eps and std choice of `cfg`, then each transform in order (they see
    the rewards, group ids and the completions' texts, and if they ask the tokens and the task's rewards
    before shaping, `task_rewards`, default `rewards`: `transform_extras`); `transforms` defaults to
    `algo.adv_transforms`."""
    index = torch.as_tensor(group_index, dtype=torch.long)
    adv = advantages(rewards, index, cfg.adv_estimator, cfg.adv_eps, cfg.adv_std_unbiased)
    for transform in make_adv_transforms(cfg) if transforms is None else transforms:
        extra = transform_extras(transform, tokens, rewards if task_rewards is None else task_rewards)
        adv = transform(adv, rewards, index, texts or [], **extra)
    return adv


def transform_extras(transform: AdvantageTransform, tokens: list | None, task_rewards: Tensor) -> dict:
    """The keyword arguments `transform` asks for (`needs_tokens`, `needs_task_rewards`)."""
    extra: dict[str, Any] = {"tokens": tokens} if transform.needs_tokens else {}
    if transform.needs_task_rewards:
        extra["task_rewards"] = task_rewards
    return extra
