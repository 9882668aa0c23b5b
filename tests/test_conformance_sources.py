"""Conformance of every registered group source (`GROUP_SOURCES`, chosen by sampling.method) and wrapper
(`WRAPPERS`, turned on by its `key`, around the fresh source): each built by the trainer (`make_group_source`)
and run for a few steps through the rollout layer on a tiny model, over fewer task rows than groups a step (a
row drawn twice in a step, where the source allows it), with partial rollouts where the source allows them.
Checked: every sample draws a stream (seed, key) of its own, across the rounds of a step and across steps; a
source restored from its `state_dict` plans exactly what the original plans next, in every round; `select`
returns a subset of the scored groups; and what a class declares (refills, the rounds it needs, recordable
samples, groups that grow) is what it does. A new class is tested by registering it; `NEEDS` says what one
takes beyond its own setting."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from sparserl.config.errors import ConfigError
from sparserl.rollout import (
    GROUP_SOURCES,
    WRAPPERS,
    GroupPlan,
    GroupRecord,
    GroupSource,
    check_group_sources,
    make_group_source,
)
from sparserl.rollout.layer import Collected
from sparserl.rollout.sources import chosen_sources, step_seed
from sparserl.trainer import Trainer
from tests.registered import Needs
from tests.test_trainer import ParityTask, tiny_cfg


class ThreeRows(ParityTask):
    """Fewer rows than a step's groups: some row is drawn twice in a step."""

    def __len__(self) -> int:
        return 3


K = 4  # groups a step, more than the task's rows
STEPS = 3
SETTINGS = (f"rollout.prompts_per_step={K}", "rollout.max_new_tokens=6")
REGISTRIES = {"method": GROUP_SOURCES, "wrapper": WRAPPERS}
NEEDS = {
    "swarm": Needs(("distributed.swarm.pool=conformance",), "a local Ray starts for its pool (~10 s)", "ray"),
}


def classes() -> list:
    """One parameter per registered source and wrapper, marked slow where building it is."""
    return [
        NEEDS.get(name, Needs()).param(kind, name, id=f"{kind}-{name}")
        for kind, registry in REGISTRIES.items()
        for name in sorted(registry)
    ]


each_class = pytest.mark.parametrize(("kind", "name"), classes())


def setting(kind: str, name: str) -> str:
    """The config setting that turns the class on."""
    return f"{GROUP_SOURCES.key}={name}" if kind == "method" else WRAPPERS[name].key


def config(tmp_path, kind: str, name: str, *extra: str, run: str = "run") -> Any:
    needs = NEEDS.get(name, Needs())
    needs.importable()
    return tiny_cfg(tmp_path, setting(kind, name), *SETTINGS, *needs.settings, *extra, name=run)


def refusal(tmp_path, kind: str, name: str, *extra: str) -> str:
    """The error a run of the class with these settings meets at its start (the config's or the sources' checks)."""
    with pytest.raises(ConfigError) as refused:
        check_group_sources(config(tmp_path, kind, name, *extra, run="refused"))
    return str(refused.value)


def build(tmp_path, kind: str, name: str, *extra: str, run: str = "run", partial: bool = False) -> Trainer:
    """A trainer whose source the registered class is part of. With `partial`, APRIL's partial rollouts are on
    where the source allows them (no refills): the groups a step does not train on resume at the next."""
    if partial:
        try:
            return build(tmp_path, kind, name, *extra, "rollout.partial.enable=true", run=f"{run}-partial")
        except ConfigError as e:
            if "rollout.partial.enable" not in str(e):
                raise
    cfg = config(tmp_path, kind, name, *extra, run=run)
    assert REGISTRIES[kind][name] in chosen_sources(cfg), f"{setting(kind, name)} does not turn {name} on"
    return Trainer(cfg, task=ThreeRows(), eval_task=ThreeRows())


@pytest.fixture(scope="module", autouse=True)
def no_ray_left():
    """A wrapper whose pool is a Ray actor starts a local Ray, as a run does: shut it at the module's end."""
    ray = sys.modules.get("ray")
    before = ray is not None and ray.is_initialized()
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and not before:
        ray.shutdown()


def new_streams(plans: Iterable[GroupPlan]) -> list[tuple[int, int]]:
    """The streams (seed, key) the plans start: every plan's but a resumed group's (it continues its own)."""
    return [(p.seed, key) for p in plans if p.resume is None for key in p.keys]


def plain(p: GroupPlan) -> Any:
    """A plan as plain values, taken when it is made (the layer grows the groups it extends afterwards)."""
    drafts = p.drafts and [d and [d.tokens, d.logps, d.finish, d.verify, d.origin] for d in p.drafts]
    resume = p.resume and p.resume.to_dict()
    extends = p.extends and (p.extends.group_id, len(p.extends.samples))
    return json.loads(json.dumps([p.row, p.seed, p.keys, p.max_new_tokens, resume, extends, drafts]))


@dataclass
class Step:
    """What one step asked of the source and got: each round's plans (those `grow` made while the round ran
    included), the groups `select` was given and chose."""

    rounds: list[list[Any]] = field(default_factory=list)
    grown: int = 0  # plans made by `grow`, in flight
    plans: list[GroupPlan] = field(default_factory=list)
    scored: list[GroupRecord] = field(default_factory=list)
    chosen: list[GroupRecord] = field(default_factory=list)
    got: Collected | None = None


def run_step(trainer: Trainer, source: GroupSource, version: int) -> Step:
    """One step of `source` through the trainer's rollout layer at policy `version`, its calls recorded."""
    step = Step()
    plan, refill, select, grow = source.plan, source.refill, source.select, source.grow

    def planned(plans: list[GroupPlan]) -> list[GroupPlan]:
        if plans:
            step.rounds.append([plain(p) for p in plans])
            step.plans += plans
        return plans

    def grown(group: GroupRecord, sample: Any) -> GroupPlan | None:
        p = grow(group, sample)
        if p is not None:
            step.rounds[-1].append(plain(p))
            step.plans.append(p)
            step.grown += 1
        return p

    def selected(scored: list[GroupRecord], k: int) -> list[GroupRecord]:
        step.scored, step.chosen = list(scored), select(scored, k)
        return step.chosen

    source.plan = lambda k, v: planned(plan(k, v))
    source.refill = lambda scored, k, v: planned(refill(scored, k, v))
    source.select, source.grow = selected, grown
    try:
        trainer.push_weights(version)
        seed = step_seed(trainer.cfg.trainer.seed, version)
        step.got = trainer.rollouts.collect_step(source, K, version, seed)
    finally:
        del source.plan, source.refill, source.select, source.grow
    return step


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Callable[[str, str], tuple[Trainer, list[Step]]]:
    """(kind, name) -> its trainer and STEPS steps: one run per class for the module's tests that only read."""
    runs: dict[tuple[str, str], tuple[Trainer, list[Step]]] = {}

    def get(kind: str, name: str) -> tuple[Trainer, list[Step]]:
        if (kind, name) not in runs:
            trainer = build(tmp_path_factory.mktemp(name), kind, name, partial=True)
            runs[kind, name] = trainer, [run_step(trainer, trainer.source, v) for v in range(STEPS)]
        return runs[kind, name]

    return get


@each_class
def test_every_sample_draws_a_stream_of_its_own(kind, name, ran):
    """Across every round of a step and across steps: a stream (seed, key) belongs to one sample (a group
    resumed at a later step continues its samples' streams; a sample started from a draft that carries its
    stream, SPEC-RL's coupled acceptance, continues that stream at a later step), and no two plans of a step
    start the same one."""
    _, steps = ran(kind, name)
    owner: dict[tuple[int, int], tuple[int, int]] = {}
    for step in steps:
        started = new_streams(step.plans)
        assert len(started) == len(set(started)), "two plans of one step start the same stream"
        drafts = [
            d.stream for p in step.plans for d in p.drafts or [] if d is not None and d.stream is not None
        ]
        assert len(drafts) == len(set(drafts)), "two drafts of one step carry the same stream"
        taken: set[tuple[int, int]] = set()
        for g in step.scored + step.got.leftover:
            for j, s in enumerate(g.samples):
                stream = (s.seed, s.key)
                if stream in drafts and stream not in taken:  # continues the draft's stream: its owner now
                    owner[stream] = (g.group_id, j)
                    taken.add(stream)
                assert owner.setdefault(stream, (g.group_id, j)) == (g.group_id, j), (
                    f"stream {stream} drawn by two samples"
                )


@each_class
def test_select_returns_a_subset_of_the_scored_groups(kind, name, ran):
    _, steps = ran(kind, name)
    for step in steps:
        chosen = [id(g) for g in step.chosen]
        assert chosen, "select chose nothing"
        assert len(set(chosen)) == len(chosen), "select chose a group twice"
        assert set(chosen) <= {id(g) for g in step.scored}, "select chose a group that was not scored"
        assert [id(g) for g in step.got.groups] == chosen


@each_class
def test_the_rounds_a_class_declares_are_the_rounds_it_takes(kind, name, ran, tmp_path):
    """A source that does not refill runs one round; one that needs its rounds (`needs_its_rounds`) runs exactly
    the extra rounds its classes declare on a backend that keeps rounds (fewer where its samples joined the
    running run: `grow` on a backend that `grows_runs`), and a round cap below them is refused; none passes the
    cap."""
    trainer, steps = ran(kind, name)
    cfg, source = trainer.cfg, trainer.source
    chain = chosen_sources(cfg)
    need = sum(c.rounds(cfg) for c in chain)
    strict = any(c.needs_its_rounds for c in chain)
    for step in steps:
        rounds = len(step.rounds)
        assert 1 <= rounds <= 1 + cfg.sampling.max_extra_rounds
        assert step.got.sampling["rounds"] == rounds
        assert source.refills or rounds == 1, "a source that does not declare refills asked for another round"
        assert not strict or rounds == 1 + need or step.grown, f"{rounds - 1} extra rounds, {need} declared"
    if strict and any(step.grown for step in steps):  # the same on a backend that keeps rounds
        kept = build(tmp_path, kind, name, run="rounds")
        kept.rollouts.backend.grows_runs = False
        step = run_step(kept, kept.source, 0)
        assert len(step.rounds) == 1 + need and not step.grown, (
            f"{len(step.rounds) - 1} rounds, {need} declared"
        )
    if strict:
        capped = refusal(tmp_path, kind, name, f"sampling.max_extra_rounds={need - 1}")
        assert f"sampling.max_extra_rounds >= {need}" in capped


@each_class
def test_recording_and_groups_of_one_as_declared(kind, name, tmp_path):
    """Every class `recordable`: a step records each trained sample (the layer refuses one it cannot), else the
    config asking for recordings is refused. A class whose groups grow (`grows_groups`) trains groups of more
    than one sample from rollout.n=1; one that needs reward variance is refused rollout.n=1 otherwise."""
    classes = chosen_sources(config(tmp_path, kind, name))
    if all(c.recordable for c in classes):
        trainer = build(tmp_path, kind, name, "trainer.log_acceptance=true", run="recorded")
        got = run_step(trainer, trainer.source, 0).got
        assert len(got.recorded) == sum(len(g.samples) for g in got.groups)
    else:
        assert setting(kind, name) in refusal(tmp_path, kind, name, "trainer.log_acceptance=true")
    if any(c.grows_groups for c in classes):
        trainer = build(tmp_path, kind, name, "rollout.n=1", run="one")
        assert max(len(g.samples) for g in run_step(trainer, trainer.source, 0).got.groups) > 1
    elif any(c.needs_reward_variance for c in classes):
        assert "rollout.n=1" in refusal(tmp_path, kind, name, "rollout.n=1")


@each_class
def test_a_restored_source_plans_what_the_original_plans_next(kind, name, tmp_path):
    """After two steps, a source built afresh from the same context and given the original's state (as a
    checkpoint keeps it: JSON) plans the third step exactly as the original does, every round, chooses the
    same groups and ends with the same state."""
    trainer = build(tmp_path, kind, name, partial=True)
    for version in range(2):
        run_step(trainer, trainer.source, version)
    state = json.loads(json.dumps(trainer.source.state_dict()))
    layer = dataclasses.replace(trainer.rollouts.state)
    restored = make_group_source(trainer.source.ctx)
    restored.load_state_dict(state)
    original = run_step(trainer, trainer.source, 2)
    trainer.rollouts.state = layer
    again = run_step(trainer, restored, 2)
    assert again.rounds == original.rounds
    assert [g.to_dict() for g in again.chosen] == [g.to_dict() for g in original.chosen]
    assert json.dumps(restored.state_dict()) == json.dumps(trainer.source.state_dict())
