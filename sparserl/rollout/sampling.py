"""Group sources that spend a step's rollouts where they teach: DARS (more samples for hard prompts), VCRL
(prompts by the variance of their rewards, with a memory bank) and DAPO's dynamic sampling (drop groups without
signal and refill), all on the `GroupSource` seam: `plan` a first round, `refill` after each scored round,
`select` the groups to train on. Every source sits behind the leftover buffer (`make_group_source`).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from sparserl.algo.advantages import ADV_ESTIMATORS
from sparserl.config.checks import sampler_records
from sparserl.config.errors import ConfigError
from sparserl.config.sampling import SamplingConfig
from sparserl.rollout import reuse as _reuse  # noqa: F401 - registers its wrapper
from sparserl.rollout import swarm as _swarm  # noqa: F401 - registers its wrapper (imports Ray only when built)
from sparserl.rollout import tree as _tree  # noqa: F401 - registers its wrapper
from sparserl.rollout.records import GroupRecord
from sparserl.rollout.sources import (
    EXTENSION_SHIFT,
    FreshPrompts,
    GroupPlan,
    GroupSource,
    LeftoverBuffer,
    SourceContext,
    WrappedSource,
    chosen_sources,
    register_group_source,
    register_wrapper,
)


def flat(g: GroupRecord) -> bool:
    """All rewards of the group equal: no group-relative signal."""
    return len({s.reward for s in g.samples}) == 1


def accuracy(g: GroupRecord) -> Fraction:
    """The group's mean reward, exactly (1/1 rewards sum exactly), clamped to [0, 1]."""
    mean = sum(Fraction(s.reward) for s in g.samples) / len(g.samples)
    return min(Fraction(1), max(Fraction(0), mean))


# --------------------------------------------------------------------------------------------------- DARS


def _least_int(estimate: float, holds: Any) -> int:
    """The least integer m with `holds(m)` (a predicate monotone in m), starting from a float estimate and
    stepping with the exact predicate, so a float's rounding never moves the answer."""
    m = math.ceil(estimate)
    while holds(m - 1):
        m -= 1
    while not holds(m):
        m += 1
    return m


def dars_extra_samples(a: Fraction, n: int, n_max: int, schedule: str = "et", std: bool = False) -> int:
    """DARS's extra samples for a prompt of first-round accuracy `a` over `n` samples, capped at n_max - n.

    S(a), the cumulative |advantage| per sample, is 2a(1 - a) without std normalisation (peak N/2 at a = 1/2)
    and 2 sqrt(a(1 - a)) with it (peak N). 'et' brings the prompt to the peak: dN = (A_peak - N S(a)) / S(a);
    'hw' to 2(1 - a) x the peak. Only a < 1/2 gets extras; a = 0 counts as 1/(2N). Exact: the least integer
    at or above dN, found by comparing squares of rationals, so 7.9999999 never becomes 9."""
    if a <= Fraction(1, 10**6):
        a = Fraction(1, 2 * n)
    if a >= Fraction(1, 2):
        return 0
    q = a * (1 - a)
    if not std:  # closed forms: et N(1/(4q) - 1), hw N(1 - 2a)/(2a)
        need = n * (1 / (4 * q) - 1) if schedule == "et" else n * (1 - 2 * a) / (2 * a)
        extra = math.ceil(need)
    elif schedule == "et":  # m >= N / (2 sqrt q) - N  <=>  4 q (m + N)^2 >= N^2 (m + N >= 0)
        estimate = n / (2 * math.sqrt(q)) - n
        extra = _least_int(estimate, lambda m: m + n >= 0 and 4 * q * (m + n) ** 2 >= n * n)
    else:  # m >= N sqrt((1 - a) / a) - N  <=>  a (m + N)^2 >= N^2 (1 - a) (m + N >= 0)
        estimate = n * math.sqrt((1 - a) / a) - n
        extra = _least_int(estimate, lambda m: m + n >= 0 and a * (m + n) ** 2 >= n * n * (1 - a))
    return max(0, min(extra, n_max - n))


@register_group_source("dars")
class Dars(FreshPrompts):
    """Extra samples for hard prompts in a second round (DARS). A first round of n samples per prompt, then
    extra samples for the prompts whose accuracy is below 1/2 (sampling.dars_schedule, up to
    sampling.dars_n_max in all), on the same group id, so advantages take the enlarged group. Groups still
    all-wrong or all-right are left out of the batch (the paper's filter) unless sampling.dars_keep_degenerate. The schedule's std follows the estimator's (`std_normalised`)."""

    refills = True
    recordable = False

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.cfg: SamplingConfig = ctx.cfg.sampling
        self.std = ADV_ESTIMATORS.lookup(ctx.cfg.algo.adv_estimator).std_normalised
        self.extended: set[int] = set()  # group ids given their extras this step
        self.unsolved: set[int] = set()  # first-round all-wrong group ids this step
        self.step = {"dars_extra_samples": 0.0, "dars_saved": 0.0, "dars_hard_prompts": 0.0}

    @classmethod
    def rounds(cls, cfg: Any) -> int:
        return 1  # the extra samples' round

    @classmethod
    def check(cls, cfg: Any) -> None:
        if cfg.sampling.dars_n_max <= cfg.rollout.n:
            raise ConfigError(
                f"sampling.dars_n_max={cfg.sampling.dars_n_max} leaves no extra samples above rollout.n="
                f"{cfg.rollout.n}: DARS would do nothing"
            )

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        if self.new_step(version):
            self.extended, self.unsolved = set(), set()
            self.step = dict.fromkeys(self.step, 0.0)
        return super().plan(k, version)

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        plans = []
        for g in scored:
            if g.group_id in self.extended:
                continue
            self.extended.add(g.group_id)
            if all(s.reward <= 0 for s in g.samples):
                self.unsolved.add(g.group_id)
            n = len(g.samples)
            extra = dars_extra_samples(accuracy(g), n, self.cfg.dars_n_max, self.cfg.dars_schedule, self.std)
            if extra:
                first = g.samples[0].key
                keys = [first + (j << EXTENSION_SHIFT) for j in range(n, n + extra)]
                plans.append(GroupPlan(g.prompt_id, g.samples[0].seed, keys, extends=g))
                self.step["dars_extra_samples"] += extra
                self.step["dars_hard_prompts"] += 1
        return plans

    def select(self, scored: list[GroupRecord], k: int) -> list[GroupRecord]:
        saved = [g for g in scored if g.group_id in self.unsolved and any(s.reward > 0 for s in g.samples)]
        self.step["dars_saved"] = len(saved) / max(1, len(self.unsolved))
        kept = scored if self.cfg.dars_keep_degenerate else [g for g in scored if not flat(g)]
        return kept or scored  # nothing left to learn from: the (zero-advantage) groups as they are

    def metrics(self) -> dict[str, float]:
        return {f"sampling/{k}": v for k, v in self.step.items()}


# --------------------------------------------------------------------------------------------------- VCRL


def normalised_variance(rewards: list[float]) -> float:
    """VCRL's p = var / var_max of a group's rewards: the unbiased variance over the largest a group of that
    size can have with rewards in [0, 1] (G / (4 (G - 1)) for even G, (G + 1) / (4 G) for odd G); 0 for G < 2."""
    g = len(rewards)
    if g < 2:
        return 0.0
    mean = sum(rewards) / g
    var = sum((r - mean) ** 2 for r in rewards) / (g - 1)
    var_max = g / (4 * (g - 1)) if g % 2 == 0 else (g + 1) / (4 * g)
    return min(1.0, var / var_max)


@register_group_source("vcrl")
class Vcrl(FreshPrompts):
    """Prompts chosen by the variance of their group rewards, with a memory bank of high-variance prompts (VCRL).
    Groups are scored by p, their rewards' normalised variance. Prompts with p >= sampling.vcrl_kappa
    enter a memory bank (priority p, an EMA when seen again; out after vcrl_max_age steps unseen or when the
    bank is full); each step replays up to vcrl_replay_fraction of its groups from the bank, highest priority
    first, and fresh prompts fill the rest. Groups below kappa are dropped and their slots refilled (bank
    first) in later rounds; short of k kept groups, the best dropped ones fill the batch (counted)."""

    refills = True
    recordable = False
    needs_reward_variance = True

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.cfg: SamplingConfig = ctx.cfg.sampling
        self.bank: dict[int, list[float]] = {}  # row -> [priority, version last seen]
        self.seen_groups: set[int] = set()
        self.in_step: set[int] = set()
        self.version = 0
        self.step = {"vcrl_replayed": 0.0, "vcrl_groups": 0.0, "vcrl_filled": 0.0, "vcrl_mean_p": 0.0}

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        if self.new_step(version):
            self.bank = {r: e for r, e in self.bank.items() if version - e[1] <= self.cfg.vcrl_max_age}
            self.seen_groups, self.in_step, self.version = set(), set(), version
            self.step = dict.fromkeys(self.step, 0.0)
        return self._groups(k, math.floor(k * self.cfg.vcrl_replay_fraction), version)

    def _groups(self, k: int, replays: int, version: int) -> list[GroupPlan]:
        """k groups of prompts not yet in this step: up to `replays` from the bank, the rest fresh."""
        ranked = sorted((r for r in self.bank if r not in self.in_step), key=lambda r: (-self.bank[r][0], r))
        rows = ranked[:replays]
        fresh, tries = [], 0
        while len(rows) + len(fresh) < k and tries < len(self.ctx.rows):  # a prompt at most once a step
            row = self.choose(1, version)[0]
            tries += 1
            if row not in self.in_step and row not in rows and row not in fresh:
                fresh.append(row)
        self.in_step.update(rows + fresh)
        self.step["vcrl_replayed"] += len(rows)
        self.step["vcrl_groups"] += len(rows) + len(fresh)
        return [self.new_group(row, version) for row in rows + fresh]

    def _learn(self, scored: list[GroupRecord], version: int) -> None:
        """Each newly scored group updates the bank once: an EMA for a banked prompt, entry at p >= kappa."""
        c = self.cfg
        for g in scored:
            if g.group_id in self.seen_groups:
                continue
            self.seen_groups.add(g.group_id)
            p = normalised_variance([s.reward for s in g.samples])
            if g.prompt_id in self.bank:
                old = self.bank[g.prompt_id][0]
                self.bank[g.prompt_id] = [c.vcrl_ema * old + (1 - c.vcrl_ema) * p, version]
            elif p >= c.vcrl_kappa and c.vcrl_bank_size > 0:
                self.bank[g.prompt_id] = [p, version]
        while len(self.bank) > c.vcrl_bank_size:
            del self.bank[min(self.bank, key=lambda r: (self.bank[r][0], -r))]

    def _kept(self, scored: list[GroupRecord]) -> list[GroupRecord]:
        return [
            g for g in scored if normalised_variance([s.reward for s in g.samples]) >= self.cfg.vcrl_kappa
        ]

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        self._learn(scored, self.version)
        need = k - len(self._kept(scored))
        return self._groups(need, need, version) if need > 0 else []

    def select(self, scored: list[GroupRecord], k: int) -> list[GroupRecord]:
        kept = self._kept(scored)[:k]
        if len(kept) < k:
            rest = [g for g in scored if all(g is not h for h in kept)]
            rest.sort(key=lambda g: -normalised_variance([s.reward for s in g.samples]))
            self.step["vcrl_filled"] = float(min(len(rest), k - len(kept)))
            kept += rest[: k - len(kept)]
        ps = [normalised_variance([s.reward for s in g.samples]) for g in kept]
        self.step["vcrl_mean_p"] = sum(ps) / max(1, len(ps))
        return kept

    def observe(self, groups: list[GroupRecord], leftover: list[GroupRecord]) -> None:
        self._learn(groups, self.version)

    def metrics(self) -> dict[str, float]:
        s = self.step
        return {
            "sampling/vcrl_bank_size": float(len(self.bank)),
            "sampling/vcrl_replay_frac": s["vcrl_replayed"] / max(1.0, s["vcrl_groups"]),
            "sampling/vcrl_filled_groups": s["vcrl_filled"],
            "sampling/vcrl_mean_p": s["vcrl_mean_p"],
        }

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "bank": {str(r): e for r, e in self.bank.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.bank = {int(r): [float(e[0]), int(e[1])] for r, e in state["bank"].items()}


# ------------------------------------------------------------------------------------------ DAPO dynamic


@register_wrapper("dynamic")
class DynamicSampling(WrappedSource):
    """DAPO's dynamic sampling around any source: groups whose rewards are all equal are dropped, and new
    groups (the inner source's `plan`) are run until k groups with a signal are in or the layer's round cap
    is reached; short of k, dropped groups fill the batch (counted in sampling/dynamic_filled_groups)."""

    refills = True
    recordable = False
    needs_reward_variance = True
    order, key = 20, "sampling.dynamic=true"

    def __init__(self, inner: GroupSource) -> None:
        super().__init__(inner)
        self.step = {"dynamic_extra_groups": 0.0, "dynamic_filled_groups": 0.0}

    def reset_step(self) -> None:
        self.step = dict.fromkeys(self.step, 0.0)

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        more = self.inner.refill(scored, k, version)
        if more:
            return more
        need = k - sum(not flat(g) for g in self.inner.select(scored, k))
        if need <= 0:
            return []
        self.step["dynamic_extra_groups"] += need
        return self.inner.plan(need, version)

    def select(self, scored: list[GroupRecord], k: int) -> list[GroupRecord]:
        chosen = self.inner.select(scored, k)
        kept = [g for g in chosen if not flat(g)][:k]
        fill = [g for g in scored if flat(g)][: k - len(kept)]  # the inner source may have dropped them
        self.step["dynamic_filled_groups"] = float(len(fill))
        return kept + fill

    def metrics(self) -> dict[str, float]:
        return {**{f"sampling/{k}": v for k, v in self.step.items()}, **self.inner.metrics()}


def make_group_source(ctx: SourceContext) -> LeftoverBuffer:
    """The run's source (`ctx.cfg`): the registered `sampling.method`, then around it each registered wrapper
    the config enables (tree rollouts, dynamic sampling, SPEC-RL's reuse, SAPO's sharing...), innermost first,
    all behind the leftover buffer (APRIL's with partial rollouts)."""
    check_group_sources(ctx.cfg)
    method, *wrappers = chosen_sources(ctx.cfg)
    source = method(ctx)
    for wrapper in wrappers:
        source = wrapper.around(source)
    return LeftoverBuffer(source, ctx.cfg.rollout.partial)


def check_group_sources(cfg: Any) -> None:
    """Refuse what the run's source cannot do, from what its classes declare (never their names): the rounds
    they need, groups of one for those that need reward variance, recording with those that do not decode
    each sample whole in one round, and each class's own `check`."""
    chosen = chosen_sources(cfg)
    for cls in chosen:
        cls.check(cfg)
    need = {cls.switch(cfg): cls.rounds(cfg) for cls in chosen if cls.rounds(cfg)}
    strict = any(cls.needs_its_rounds for cls in chosen)  # the others take what the cap leaves them
    if strict and sum(need.values()) > cfg.sampling.max_extra_rounds:
        parts = " and ".join(f"{k} ({n} extra round{'s' * (n > 1)})" for k, n in need.items())
        raise ConfigError(
            f"{parts} needs sampling.max_extra_rounds >= {sum(need.values())} (now "
            f"{cfg.sampling.max_extra_rounds}): each is a round of the step"
        )
    variance = [c.switch(cfg) for c in chosen if c.needs_reward_variance]
    if variance and cfg.rollout.n == 1 and not any(c.grows_groups for c in chosen):
        raise ConfigError(
            f"{' and '.join(variance)} with rollout.n=1: a group of one sample has zero reward variance, so every "
            "step would run all sampling.max_extra_rounds for nothing; set rollout.n >= 2"
        )
    unrecorded = [c.switch(cfg) for c in chosen if not c.recordable]
    recording = sampler_records(cfg)
    if unrecorded and recording:
        raise ConfigError(
            f"{', '.join(unrecorded)} starts samples from others or adds rounds to a step, whose distributions and "
            f"held positions are not recorded: it cannot run with {' or '.join(recording)}"
        )
