"""Group sources: which groups a step runs. One small class per method behind one short interface.

`plan(k, version)` -> `GroupPlan`s (a task row, one stream key per sample, optionally drafts to start from);
`observe(groups, leftover)` gets the step's groups back (the trained ones finished and scored, the rest
unfinished or unused), so a source can learn from rewards; `state_dict()` / `load_state_dict()` make it part
of the checkpoint. Built-in: `fresh` (rows from a seeded permutation per epoch); every source sits behind the
leftover buffer, which runs the groups a step did not train on first at the next (APRIL's partial rollouts). Register your own with
`@register_group_source("name")` and select it with `sampling.method=name`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

from sparserl.config.errors import ConfigError
from sparserl.config.rollout import PartialConfig
from sparserl.registry import Registry
from sparserl.rollout.records import GroupRecord, SampleRecord
from sparserl.seeds import ROLLOUT, PromptSampler, derive_seed

# A row drawn twice in one step: occurrence o > 0 of the row shifts its keys by o << OCCURRENCE_SHIFT, so every
# planned group of a step has its own streams while occurrence 0 keeps the key `row * n + j`. A group's extra
# samples (a later round's, DARS) shift its first key by j << EXTENSION_SHIFT, j >= 1 their index in the group.
OCCURRENCE_SHIFT = 40
EXTENSION_SHIFT = 48


@dataclass
class Draft:
    """Tokens a sample starts from, kept by the rollout layer as follows:
    - `logps` None (a given prefix, `Draft.prefix`; or a shared sample trained with ratio 1): kept whole, its
      sampler log-probs the verifier's now;
    - `logps` and `verify` (SPEC-RL: a previous response, `logps` the verifier's under the weights that drew
      it): kept up to the first rejected token;
    - `logps` without `verify` (a shared sample with its sender's log-probs): kept whole with them;
    - `stream` (SPEC-RL's coupled acceptance: the (seed, key) the draft was drawn on): kept up to the first token
      the current policy draws otherwise on that stream, which the sample then continues.
    A draft kept whole with a `finish` is not decoded further. `origin` is recorded on the sample."""

    tokens: list[int]
    logps: list[float] | None = None
    finish: str | None = None
    verify: bool = True
    origin: str = "reused"
    stream: tuple[int, int] | None = None
    fork_of: tuple[int, int, int] | None = None  # (seed, key, position) of the state it continues (a tree's)

    @classmethod
    def prefix(cls, tokens: list[int]) -> Draft:
        """Completion tokens to start from, as they are (their sampler log-probs: the verifier's now)."""
        return cls(list(tokens), origin="given")


@dataclass
class GroupPlan:
    """One group to run: task row `row`, samples drawing from (`seed`, `keys[j]`); `max_new_tokens[j]` caps sample j (for good) instead of
    `rollout.max_new_tokens`; `resume` continues a group already partly drawn (APRIL's leftovers); `extends`
    adds the samples to a group of this step instead of starting a new one (its advantages then take the
    enlarged group: DARS's second round); `drafts[j]`, when given, are tokens sample j starts from: a given
    prefix (`Draft.prefix`), or a previous response it verifies and continues from its first rejected token
    (SPEC-RL)."""

    row: int
    seed: int
    keys: list[int]
    max_new_tokens: list[int] | None = None
    resume: GroupRecord | None = None
    extends: GroupRecord | None = None
    drafts: list[Draft | None] | None = None
    snapshots: int = 0  # each sample keeps its states before this many least likely tokens (tree forks)

    @property
    def n(self) -> int:
        return len(self.keys)


@dataclass
class SourceContext:
    """What a source may read: the usable task rows, samples per prompt, the run's seed, config and tokenizer."""

    rows: list[int]
    n: int
    seed: int
    cfg: Any = None  # the TrainConfig (None in unit tests of the layer)
    tokenizer: Any = None  # the policy's (SAPO re-tokenises shared texts)


class GroupSource:
    """Base class: `choose(k, version)` picks k task rows; `plan` turns them into groups of `ctx.n` samples
    with unique streams. Override `plan` for variable group sizes or drafts, `refill` for more rounds in a
    step (after seeing the scored groups), `grow` for samples that join the running run as one finishes (a
    tree's children), `select` to train on some of them, `observe` to learn from rewards,
    `state_dict`/`load_state_dict` for state that must survive a resume."""

    name: ClassVar[str] = ""
    # What the source does, read by the config checks (`check_group_sources`), never its name.
    # refills: `refill` may ask for more rounds (not with partial rollouts); recordable: every trained sample
    # is decoded whole from its prompt in the step's one round; needs_reward_variance: it drops groups of equal
    # rewards (pointless with rollout.n=1); grows_groups: a group grows from one sample (a tree's leaves), so
    # rollout.n=1 has variance; needs_its_rounds: fewer `rounds` than asked is wrong, not merely less (the
    # round cap is checked against every class's rounds).
    refills: ClassVar[bool] = False
    recordable: ClassVar[bool] = True
    needs_reward_variance: ClassVar[bool] = False
    grows_groups: ClassVar[bool] = False
    needs_its_rounds: ClassVar[bool] = False

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx
        self._seen: tuple[int, Counter] = (-1, Counter())  # (version, occurrences of each row this step)

    @classmethod
    def switch(cls, cfg: Any) -> str:
        """The config setting that turns the source on, as errors name it."""
        return f"sampling.method={cls.name}"

    @classmethod
    def rounds(cls, cfg: Any) -> int:
        """The extra rounds a step needs (beyond the first) to do what the config asks."""
        return 0

    @classmethod
    def check(cls, cfg: Any) -> None:
        """Refuse settings of the config the source cannot run with (ConfigError naming the key)."""

    def choose(self, k: int, version: int) -> list[int]:
        raise NotImplementedError(f"group source {type(self).__name__} defines neither choose nor plan")

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        """k groups of `ctx.n` samples at this step's seed; every group its own streams (see OCCURRENCE_SHIFT,
        counted over every round of the step): a sample's tokens depend on (seed, row, occurrence, j) and the
        weights, not on its batch mates."""
        return [self.new_group(row, version) for row in self.choose(k, version)]

    def new_step(self, version: int) -> bool:
        """True at the first call for policy `version`: a source resets its per-step state there, not at every
        `plan` (dynamic sampling plans more groups in a step's later rounds)."""
        fresh = getattr(self, "_step_version", None) != version
        self._step_version = version
        return fresh

    def new_group(self, row: int, version: int) -> GroupPlan:
        """A group of `ctx.n` samples of `row` on streams no other group of this step draws."""
        if self._seen[0] != version:
            self._seen = (version, Counter())
        seen, n = self._seen[1], self.ctx.n
        occurrence, seen[row] = seen[row], seen[row] + 1
        keys = [(occurrence << OCCURRENCE_SHIFT) + row * n + j for j in range(n)]
        return GroupPlan(row, step_seed(self.ctx.seed, version), keys)

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        """After each round: the step's groups scored so far -> the next round's plans ([]: the step is done).
        The layer runs at most sampling.max_extra_rounds more rounds."""
        return []

    def select(self, scored: list[GroupRecord], k: int) -> list[GroupRecord]:
        """The groups to train on, out of every group the step scored (all of them by default)."""
        return scored

    def grow(self, group: GroupRecord, sample: SampleRecord) -> GroupPlan | None:
        """More samples for `group` as soon as its `sample` finished, decoded in the same run (a plan that
        `extends` it), when the backend `grows_runs`; None: none (a round-based source waits for `refill`)."""
        return None

    @property
    def needs_scores(self) -> bool:
        """True if `observe` needs each trained sample's `scored_logps` (the backend's teacher-forced log-probs
        under the weights that drew it: SPEC-RL's cache)."""
        return False

    def observe(self, groups: list[GroupRecord], leftover: list[GroupRecord]) -> None:
        """The step's trained groups (finished and scored) and the ones it did not train on."""

    def metrics(self) -> dict[str, float]:
        """Logged each step, under the names given (a source's own under sampling/)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""


def step_seed(run_seed: int, version: int) -> int:
    """The seed new groups draw at when the policy has had `version` updates (training step version + 1)."""
    return derive_seed(run_seed, version + 1, ROLLOUT)


GROUP_SOURCES: Registry[type[GroupSource]] = Registry("sampling.method")
register_group_source = GROUP_SOURCES.register  # class decorator: `sampling.method=name`


@register_group_source("fresh")
class FreshPrompts(GroupSource):
    """Rows in the order of a fresh seeded permutation per epoch (`PromptSampler`): the data position is one
    integer and a resume replays the same prompts."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.sampler = PromptSampler(len(ctx.rows), ctx.seed)

    def choose(self, k: int, version: int) -> list[int]:
        return [self.ctx.rows[i] for i in self.sampler.take(k)]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.sampler.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.position = int(state["position"])


class WrappedSource(GroupSource):
    """A source around another (`inner`): every call goes to it unless the wrapper overrides it (the leftover
    buffer, dynamic sampling, SPEC-RL's reuse, SAPO's sharing). A registered wrapper (`@register_wrapper`)
    wraps the run's source when `enabled(cfg)`, innermost first by `order`; `key` is its config setting."""

    order: ClassVar[int] = 0  # lower: closer to the method's own source
    key: ClassVar[str] = ""  # the config setting that turns it on, as errors name it

    def __init__(self, inner: GroupSource) -> None:
        super().__init__(inner.ctx)
        self.inner = inner

    @classmethod
    def enabled(cls, cfg: Any) -> bool:
        """Whether the run's config asks for this wrapper: its `key` holds ('rollout.tree.enable=true')."""
        if not cls.key:
            raise NotImplementedError(f"wrapper {cls.__name__} does not say when it is enabled")
        path, _, value = cls.key.partition("=")
        return bool(attrgetter(path)(cfg)) == (value == "true")

    @classmethod
    def around(cls, inner: GroupSource) -> WrappedSource:
        """The wrapper around `inner`, built from `inner.ctx` (its config, tokenizer)."""
        return cls(inner)

    @classmethod
    def switch(cls, cfg: Any) -> str:
        return cls.key

    @property
    def refills(self) -> bool:  # type: ignore[override]
        return self.inner.refills

    @property
    def needs_scores(self) -> bool:
        return self.inner.needs_scores

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        if self.new_step(version):
            self.reset_step()
        return self.inner.plan(k, version)

    def reset_step(self) -> None:
        """Per-step state back to its start (once per step, at the step's first `plan`)."""

    def new_group(self, row: int, version: int) -> GroupPlan:
        return self.inner.new_group(row, version)  # one count of occurrences per step, whoever plans

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        return self.inner.refill(scored, k, version)

    def select(self, scored: list[GroupRecord], k: int) -> list[GroupRecord]:
        return self.inner.select(scored, k)

    def grow(self, group: GroupRecord, sample: SampleRecord) -> GroupPlan | None:
        return self.inner.grow(group, sample)

    def observe(self, groups: list[GroupRecord], leftover: list[GroupRecord]) -> None:
        self.inner.observe(groups, leftover)

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


WRAPPERS: Registry[type[WrappedSource]] = Registry("group-source wrapper")
register_wrapper = WRAPPERS.register  # class decorator: wraps the run's source whenever `enabled(cfg)`


def chosen_sources(cfg: Any) -> list[type[GroupSource]]:
    """The classes the run's source is made of: `sampling.method`'s, then the enabled wrappers, innermost first."""
    wrappers = sorted((w for w in WRAPPERS.values() if w.enabled(cfg)), key=lambda w: w.order)
    return [GROUP_SOURCES.lookup(cfg.sampling.method), *wrappers]


class LeftoverBuffer(WrappedSource):
    """Around every source: groups a step started but did not train on (unfinished when APRIL stopped the step,
    or complete beyond its target) come back through `observe` and run first at the next step, oldest first;
    those older than `partial.max_staleness` are dropped. With partial rollouts on it over-provisions the step
    (`partial.over_provision` x k groups, APRIL); the rest come from `inner`."""

    def __init__(self, inner: GroupSource, partial: PartialConfig) -> None:
        super().__init__(inner)
        if partial.enable and inner.refills:
            raise ConfigError(
                f"group source {type(inner).__name__} runs more rounds in a step after scoring (sampling.method, "
                "sampling.dynamic), which rollout.partial.enable=true does not support yet: turn one of them off"
            )
        self.partial = partial
        self.leftover: list[dict[str, Any]] = []  # GroupRecord.to_dict(), JSON for the checkpoint
        self.dropped_groups = 0

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        want = math.ceil(k * self.partial.over_provision) if self.partial.enable else k
        plans = []
        for g in (GroupRecord.from_dict(d) for d in self.leftover):
            oldest = min((s.start_version for s in g.samples if s.tokens), default=version)
            if version - oldest > self.partial.max_staleness:
                self.dropped_groups += 1
            else:
                s0 = g.samples[0]
                plans.append(GroupPlan(g.prompt_id, s0.seed, [s.key for s in g.samples], resume=g))
        self.leftover = []
        return plans + self.inner.plan(max(0, want - len(plans)), version)

    def observe(self, groups: list[GroupRecord], leftover: list[GroupRecord]) -> None:
        self.leftover = [g.to_dict() for g in leftover]
        self.inner.observe(groups, leftover)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/partial_buffer_groups": float(len(self.leftover)),
            "rollout/partial_dropped_groups": float(self.dropped_groups),
            **self.inner.metrics(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "leftover": self.leftover,
            "dropped_groups": self.dropped_groups,
            "inner": self.inner.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.leftover, self.dropped_groups = list(state["leftover"]), int(state["dropped_groups"])
        self.inner.load_state_dict(state["inner"])
