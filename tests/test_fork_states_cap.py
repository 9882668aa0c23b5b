"""Fork states under `rollout.kv_memory_cap` (engine/forks.py, rollout/scheduler.py): they count against the cap
with the rows, a state that does not fit is not kept, kept ones are released before a sequence is preempted,
and a child whose state is gone prefills instead and draws the same tokens. A tree's flow here is the
backend's: parents keep states at their least likely tokens and, as each finishes, its children join the run."""

from __future__ import annotations

import inspect

import pytest
from test_eviction import engine, random_prompts
from test_forks import LOGP_TOL, fork_points

from sparserl.engine import KVConfig
from sparserl.engine.decoding import Request, Sampling
from sparserl.engine.rollout import run_stats
from sparserl.engine.run_memory import RunMemory
from sparserl.rollout.scheduler import Scheduler

FORKS, NEW = 2, 24


def tree_run(e, cap: int | None, parents: int = 4):
    """Parents with FORKS states each; every finished parent's children (one per fork point) join the run,
    started from the parent's state there while it is held. Returns the run, its per-step held KV bytes, the
    children's (parent, fork point, sample id) and how many started from a state."""
    prompts = random_prompts([11, 23, 17, 30][:parents], 4)
    requests = [Request(p, key=j, seed=5, max_new_tokens=NEW, snapshots=FORKS) for j, p in enumerate(prompts)]
    runs, held, children, forked = [], [], [], []
    start = e.start_run
    e.start_run = lambda *a, **k: runs.append(start(*a, **k)) or runs[-1]
    e.step_hooks.append(lambda step, cache, samples: held.append(runs[-1].held_kv_bytes()))

    def finished(run, i):
        if i >= parents:
            return None
        tokens, logps = run.completion(i)
        states = {s.position: s for s in run.snapshots.states(i)}
        out = []
        for t in fork_points(logps.tolist(), FORKS):
            out.append(Request(prompts[i], 100 + 10 * i + t, 5, NEW, tokens[:t], fork=states.get(t)))
            children.append((i, t, len(run.requests) + len(out) - 1))
            forked.append(states.get(t) is not None)
        return out

    run, unfinished, stats = Scheduler(e, cap).run(requests, Sampling(), finished)
    assert not unfinished
    return run, held, children, sum(forked), stats


def test_a_cap_holds_the_rows_and_the_fork_states_and_the_children_draw_the_same_tokens():
    e = engine(KVConfig())
    free, free_held, free_children, free_forked, _ = tree_run(e, None)
    assert free_forked == len(free_children) and free.snapshots.dropped == 0
    bpp = free.bytes_per_position
    outcomes = []
    for cap in (2 * 128 * bpp + 40 * bpp, 4 * 128 * bpp):  # tight: states must give way; roomy: most are kept
        e = engine(KVConfig())
        run, held, children, forked, stats = tree_run(e, cap)
        assert max(held) <= cap, "rows and fork states together never exceed the cap"
        assert run.peak_bytes <= cap and run.dense_bytes <= cap
        for (i, t, j), (i2, t2, j2) in zip(free_children, children, strict=True):
            assert (i, t) == (i2, t2)
            tokens, logps = run.completion(j2)
            want, want_logps = free.completion(j)
            assert tokens == want, (cap, i, t)
            assert (logps - want_logps).abs().max() < LOGP_TOL
        outcomes.append((run.snapshots.dropped, forked, stats.preemptions))
    (tight_dropped, tight_forked, _), (roomy_dropped, roomy_forked, _) = outcomes
    assert tight_dropped > 0 and tight_forked < len(free_children), "the tight cap dropped states"
    assert roomy_forked > tight_forked and roomy_dropped < tight_dropped


@pytest.fixture
def released(monkeypatch):
    """The scheduler's methods that released a fork state, in order."""
    calls = []
    release = RunMemory.release_state

    def spy(self):
        freed = release(self)
        if freed:
            calls.append(inspect.stack()[1].function)
        return freed

    monkeypatch.setattr(RunMemory, "release_state", spy)
    return calls


def test_a_state_gives_way_before_a_lone_sequence_is_cut_at_the_cap(released):
    """A row of 128 slots and a state fit; when the row must grow, the state is released, not the sequence."""
    e = engine(KVConfig())
    bpp = tree_run(engine(KVConfig()), None, parents=1)[0].bytes_per_position
    request = Request(random_prompts([100], 9)[0], key=0, seed=3, max_new_tokens=60, snapshots=3)
    run, unfinished, stats = Scheduler(e, 240 * bpp).run([request], Sampling())
    assert released == ["_preempt"] and stats.cap_truncated == 0 and stats.preemptions == 0
    assert not unfinished and len(run.completion(0)[0]) == 60


def test_states_give_way_when_nothing_runs_and_the_next_sequence_does_not_fit_beside_them(released):
    """The only running sequence finished with its states filling the cap: the waiting one is admitted once a
    state is released (the run neither stalls nor fails)."""
    e = engine(KVConfig())
    bpp = tree_run(engine(KVConfig()), None, parents=1)[0].bytes_per_position
    first = Request(random_prompts([30], 7)[0], key=0, seed=3, max_new_tokens=NEW, snapshots=3)
    late = Request(random_prompts([60], 8)[0], key=1, seed=3, max_new_tokens=NEW)

    def finished(run, i):
        if i == 0:
            assert run.snapshots.states(0), "the sequence kept states beside its row"
            return [late]
        return None

    run, unfinished, stats = Scheduler(e, 130 * bpp).run([first], Sampling(), finished)
    assert released == ["_admit"] and not unfinished and run.finish[1] is not None
    assert stats.preemptions == 0 and stats.cap_truncated == 0


@pytest.mark.parametrize("cap", [None, "tight"])
def test_the_dropped_states_are_reported(cap):
    e = engine(KVConfig())
    probe, *_ = tree_run(e, None)
    limit = None if cap is None else 2 * 128 * probe.bytes_per_position + 40 * probe.bytes_per_position
    run, *_ = tree_run(engine(KVConfig()), limit)
    assert (run_stats(run)["fork_states_dropped"] > 0) == (cap is not None)


def given_states_run(e):
    """A first run's parents keep two states each; a second run starts one child from each (states it is given,
    made elsewhere: as SPEC-RL's drafts at their cuts are). Returns both runs and the states."""
    prompts = random_prompts([11, 23], 4)
    parents = [Request(p, key=j, seed=5, max_new_tokens=NEW, snapshots=FORKS) for j, p in enumerate(prompts)]
    first, _, _ = Scheduler(e).run(parents, Sampling())
    states = [s for i in range(len(parents)) for s in first.snapshots.states(i)]
    children = [
        Request(prompts[i], 50 + j, 5, NEW, first.completion(i)[0][: s.position], fork=s)
        for j, (i, s) in enumerate((i, s) for i in range(len(parents)) for s in first.snapshots.states(i))
    ]
    return first, children, states


def test_the_states_a_run_is_given_count_in_its_peak_and_in_the_dense_yardstick():
    """Held from the run's start to its end by whoever made them, they are the run's KV memory: a dense run
    given states peaks at its rows and the states, and its yardstick counts them too (no saving claimed)."""
    e = engine(KVConfig())
    _, children, states = given_states_run(e)
    plain = Scheduler(e).run([Request(r.prompt, r.key, r.seed, NEW, r.prefix) for r in children], Sampling())[
        0
    ]
    run = Scheduler(e).run(children, Sampling())[0]
    assert len(run.snapshots.given) == len(states) == len(children) and run.snapshots.dropped == 0
    given = sum(s.nbytes for s in states)
    assert given > 0 and run.states_bytes() == given
    assert run.peak_bytes == run.dense_bytes >= given + run.cache.capacity * run.bytes_per_position
    assert plain.peak_bytes == plain.dense_bytes < run.dense_bytes


def test_a_spent_given_state_is_released_first_and_not_counted_as_dropped():
    e = engine(KVConfig())
    _, children, states = given_states_run(e)
    run = e.start_run(children, Sampling())
    spent, rest = states[0], states[1:]
    needed = {id(s) for s in rest}
    assert spent.nbytes < max(s.nbytes for s in rest)  # the prompts are 11 and 23 tokens long
    assert run.snapshots.release_largest(needed) is spent and spent.cache is None
    assert run.snapshots.dropped == 0
    largest = max(rest, key=lambda s: (s.nbytes, s.position))
    assert run.snapshots.release_largest(needed) is largest and run.snapshots.dropped == 1
    assert run.states_bytes() == sum(s.nbytes for s in states if s.held) > 0
