"""`sparserl bias`, one batch at a time: does this config's sparse sampler bias the update, and do its corrections
remove it (docs/bias.md)?

Each batch samples its prompts twice with the same random streams (engine/sampling.py: a sample's uniform numbers
depend only on the seed, its key and the step): once with the config's sampler (its KV method and
rollout.sampler_temperature) and once with the dense sampler at rollout.temperature. A sample and its dense twin
draw the same tokens until the sparse cache (or the other temperature) changes a draw, so every sparse-minus-dense
contrast is paired per sample. Every sequence is scored densely (pi_old). Per estimator (naive, the config's own
corrections, sequence-level IS, any algo preset) the batch's policy gradient at pi_theta = pi_old is taken on the
sparse samples; the reference is the naive gradient on the dense twins (on-policy, unbiased).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sparserl.algo import (
    AlgoConfig,
    advantages_from_config,
    correction_weights,
)
from sparserl.algo.config import CORRECTION_KNOBS
from sparserl.algo.presets import PRESETS
from sparserl.engine.padding import right_pad
from sparserl.errors import UserError

NAIVE, CONFIG, SEQ_IS, DENSE = "naive", "config", "seq-is", "dense"
BUILTIN_ESTIMATORS = (NAIVE, CONFIG, SEQ_IS)
# |log p_sampler - log p_old| above this marks a token where the sampler departs from the dense policy; the dense
# sampler and the dense scorer agree to float32 round-off (~1e-5 nats on SmolLM2, docs/engine.md)
DEPARTURE_TOL = 1e-3
ROLLOUT_FIELDS = ("veto_threshold", "tis_cap")  # read by the per-estimator shares below


def estimator_configs(algo: AlgoConfig, names: Sequence[str]) -> dict[str, AlgoConfig]:
    """The AlgoConfig of each estimator: 'naive' (no correction), 'config' (the config's own corrections),
    'seq-is' (every token of a sequence weighted by prod_t xi_t, untruncated: unbiased, high variance), or an
    algo preset's corrections (and SMD's distillation term) over the config's loss. KL to the reference and the entropy bonus are left out:
    their gradients do not depend on how the samples were corrected at pi_theta = pi_old = pi_ref."""
    base = dataclasses.replace(algo, kl_coef=0.0, entropy_coef=0.0)
    cleared = {k: (False if k == "tis_batch_norm" else None) for k in CORRECTION_KNOBS}
    cleared["sampler_kl_coef"] = 0.0  # SMD's pull toward the sampler is part of an estimator, never of naive
    out = {NAIVE: dataclasses.replace(base, correction_mode="none", **cleared)}
    for name in names:
        if name == CONFIG:
            out[name] = base
        elif name == SEQ_IS:
            unbounded = math.exp(algo.log_ratio_clamp)
            out[name] = dataclasses.replace(
                base, **{**cleared, "correction_mode": "decoupled", "seq_tis_cap": unbounded}
            )
        elif name in PRESETS:
            knobs = {k: v for k, v in PRESETS[name].items() if k != "sparse_rollout"}
            out[name] = dataclasses.replace(base, **{**cleared, **knobs, "kl_coef": 0.0, "entropy_coef": 0.0})
        elif name != NAIVE:
            raise UserError(
                f"--estimators: {name!r} is unknown; choose from {', '.join(BUILTIN_ESTIMATORS)} or an algo "
                f"preset ({', '.join(PRESETS)})"
            )
    return out


@dataclasses.dataclass
class Coupled:
    """One batch's coupled samples, prompt-major ([B] lists; logps [B, T] right-padded)."""

    rows: list[int]  # task row of each sample
    prompts: list[list[int]]
    sparse: list[list[int]]
    dense: list[list[int]]
    sparse_reward: Tensor
    dense_reward: Tensor
    sparse_logp: Tensor  # the sampler's recorded log-probs
    sparse_old: Tensor  # pi_old (dense, rollout.temperature) of the sparse samples
    sparse_mask: Tensor
    dense_logp: Tensor  # the dense twin's own sampler log-probs
    dense_old: Tensor  # pi_old of the dense twins
    dense_mask: Tensor
    held: tuple[Tensor, Tensor]  # mean positions held per sample: sparse, dense
    peak_kv_bytes: tuple[float, float]  # the sparse and the dense engine's own allocations
    alpha: tuple[Tensor, Tensor] | None = (
        None  # block-sparse samplers: alpha's top-k bound per token, sample ids
    )


def _group(values: Sequence[Any], n: int) -> list[list[Any]]:
    return [list(values[i : i + n]) for i in range(0, len(values), n)]


def group_ids(count: int, n: int) -> list[int]:
    return [i // n for i in range(count)]


def advantages_of(rewards: Tensor, n: int, algo: AlgoConfig) -> Tensor:
    """The config's advantages over the batch's groups of n (transforms that need a judge are left out)."""
    return advantages_from_config(rewards, group_ids(len(rewards), n), algo, transforms=[])


def per_token_gaps(c: Coupled, tol: float = DEPARTURE_TOL) -> dict[str, Tensor]:
    """[B, T] k1 = log p_sampler - log p_old and k3 = xi - 1 - log xi (xi = p_old / p_sampler) on the sparse
    samples, and the mask of tokens at or after the first departure (|k1| > tol) of each sample."""
    mask = c.sparse_mask
    k1 = torch.where(mask, c.sparse_logp - c.sparse_old, torch.zeros_like(c.sparse_logp))
    log_xi = (-k1).clamp(-20.0, 20.0)
    k3 = torch.where(mask, log_xi.exp() - 1.0 - log_xi, torch.zeros_like(k1))
    departed = ((k1.abs() > tol) & mask).int().cummax(dim=1).values.bool() & mask
    return {"k1": k1, "k3": k3, "after": departed}


def _diverged(c: Coupled) -> list[bool]:
    return [a != b for a, b in zip(c.sparse, c.dense, strict=True)]


def rollout_clusters(c: Coupled, n: int, estimators: dict[str, AlgoConfig]) -> list[dict[str, tuple]]:
    """Per prompt (a cluster of n coupled samples), {statistic: (numerator, denominator)} for every rollout
    statistic of docs/bias.md, the corrections' shares of each estimator included."""
    gaps = per_token_gaps(c)
    diverged = torch.tensor(_diverged(c), dtype=torch.float64)
    flips = (c.sparse_reward != c.dense_reward).double()
    tokens = c.sparse_mask.sum(dim=1).double()
    after = gaps["after"].sum(dim=1).double()
    per_sample = {
        "reward_sampler": (c.sparse_reward.double(), torch.ones_like(flips)),
        "reward_dense": (c.dense_reward.double(), torch.ones_like(flips)),
        "reward_ratio": (c.sparse_reward.double(), c.dense_reward.double()),
        "reward_flip_rate": (flips, torch.ones_like(flips)),
        "diverged_share": (diverged, torch.ones_like(flips)),
        "departed_share": ((after > 0).double(), torch.ones_like(flips)),
        "k1_token": (gaps["k1"].sum(dim=1).double(), tokens),
        "k3_token": (gaps["k3"].sum(dim=1).double(), tokens),
        "k1_after_departure": ((gaps["k1"] * gaps["after"]).sum(dim=1).double(), after),
        "k3_after_departure": ((gaps["k3"] * gaps["after"]).sum(dim=1).double(), after),
        "log_gap_seq": (gaps["k1"].sum(dim=1).double(), torch.ones_like(flips)),
        "length_sampler": (tokens, torch.ones_like(flips)),
        "length_dense": (c.dense_mask.sum(dim=1).double(), torch.ones_like(flips)),
        "kv_saving_mean_held": (c.held[0].double(), c.held[1].double()),
    }
    adv = advantages_of(c.sparse_reward, n, next(iter(estimators.values())))
    for name, algo in estimators.items():
        if name != NAIVE:
            per_sample.update(correction_shares(c, algo, adv, flips, name))
    clusters = []
    for start in range(0, len(c.rows), n):
        rows = slice(start, start + n)
        cluster = {
            k: (float(num[rows].sum()), float(den[rows].sum())) for k, (num, den) in per_sample.items()
        }
        rewards = c.sparse_reward[rows]
        cluster["nondegenerate_groups"] = (float(bool((rewards != rewards[0]).any())), 1.0)
        dense_rewards = c.dense_reward[rows]
        cluster["nondegenerate_groups_dense"] = (float(bool((dense_rewards != dense_rewards[0]).any())), 1.0)
        clusters.append(cluster)
    return clusters


def correction_shares(
    c: Coupled, algo: AlgoConfig, adv: Tensor, flips: Tensor, name: str
) -> dict[str, tuple[Tensor, Tensor]]:
    """What one estimator's corrections do to the sparse samples, per sample (numerator, denominator): tokens
    masked, sequences vetoed / rejected, tokens whose TIS weight is truncated, sequences touched by any of these,
    the veto's precision and recall against reward flips, and the share of sequences with a truncated token that
    the veto rejects."""
    mask = c.sparse_mask
    _, keep, _ = correction_weights(c.sparse_old, c.sparse_logp, mask, algo, adv)
    has = mask.any(dim=1)
    rejected = has & ~keep.any(dim=1)
    masked = mask & ~keep & ~rejected[:, None]
    log_xi = torch.where(mask, c.sparse_old - c.sparse_logp, torch.zeros_like(c.sparse_old))
    truncated = (
        mask & (log_xi > math.log(algo.tis_cap)) if algo.tis_cap is not None else torch.zeros_like(mask)
    )
    vetoed = (
        (mask & (log_xi < math.log(algo.veto_threshold))).any(dim=1)
        if algo.veto_threshold is not None and algo.correction_mode != "none"
        else torch.zeros_like(has)
    )
    touched = rejected | masked.any(dim=1) | truncated.any(dim=1)
    one, tokens = torch.ones_like(flips), mask.sum(dim=1).double()
    v = vetoed.double()
    return {
        f"{name}/token_mask_share": (masked.sum(dim=1).double(), tokens),
        f"{name}/tis_truncation_share": (truncated.sum(dim=1).double(), tokens),
        f"{name}/seq_rejected_share": (rejected.double(), one),
        f"{name}/veto_share": (v, one),
        f"{name}/touched_share": (touched.double(), one),
        f"{name}/veto_precision": (v * flips, v),
        f"{name}/veto_recall": (v * flips, flips),
        f"{name}/veto_catch_of_truncated": (v * truncated.any(dim=1).double(), truncated.any(dim=1).double()),
    }


def padded(rows: Sequence[Sequence[float] | Tensor], width: int | None = None) -> tuple[Tensor, Tensor]:
    """Float32 [B, T] right-padded log-probs and their bool mask."""
    return right_pad(list(rows), torch.float32, width=width)
