"""Fork states under `rollout.kv_memory_cap` (engine/forks.py, rollout/scheduler.py): they count against the cap
with the rows, a state that does not fit is not kept, kept ones give way before a sequence is preempted, and a
child whose state is gone prefills instead and draws the same tokens (`rollout/fork_prefills` counts it). A
tree's flow here is the backend's: parents keep states at their least likely tokens and, as each finishes, its
children join the run. States a run is given (made elsewhere, as SPEC-RL's drafts at their cuts) are its KV
memory too."""

from __future__ import annotations

import inspect

import pytest
from test_eviction import engine, random_prompts
from test_forks import KVS, LOGP_TOL, fork_points

from sparserl.engine import KVConfig
from sparserl.engine.decoding import Request, Sampling
from sparserl.engine.rollout import run_stats
from sparserl.engine.run_memory import RunMemory
from sparserl.rollout.scheduler import Scheduler

FORKS, NEW = 2, 24


def bytes_per_position() -> int:
    e = engine(KVConfig())
    return e.start_run([Request([5, 6], key=0, seed=0, max_new_tokens=2)], Sampling()).bytes_per_position


def tree_run(e, cap: int | None, prompts: list[list[int]], new: int = NEW, forks: int = FORKS):
    """Parents keeping `forks` states each; every finished parent's children (one per fork point, on their own
    streams) join the run, started from the parent's state there while it is held. Returns the run, its held
    KV bytes at every step, the children's (parent, fork point, sample id) and the scheduler's statistics."""
    n = len(prompts)
    requests = [Request(p, key=j, seed=5, max_new_tokens=new, snapshots=forks) for j, p in enumerate(prompts)]
    runs, held, children = [], [], []
    start = e.start_run
    e.start_run = lambda *a, **k: runs.append(start(*a, **k)) or runs[-1]
    e.step_hooks.append(lambda step, cache, samples: held.append(runs[-1].held_kv_bytes()))

    def finished(run, i):
        if i >= n:
            return None
        tokens, logps = run.completion(i)
        states = {s.position: s for s in run.snapshots.states(i)}
        out = []
        for t in fork_points(logps.tolist(), forks):
            out.append(Request(prompts[i], 100 + 10 * i + t, 5, new, tokens[:t], fork=states.get(t),
                               fork_of=(5, i, t)))  # fmt: skip
            children.append((i, t, len(run.requests) + len(out) - 1))
        return out

    run, unfinished, stats = Scheduler(e, cap).run(requests, Sampling(), finished)
    assert not unfinished
    return run, held, children, stats


def same_children(run, children, free, free_children) -> None:
    """The children of `run` drew the tokens (and log-probs, within the engine's tolerance) of `free`'s."""
    for (i, t, j), (i2, t2, j2) in zip(free_children, children, strict=True):
        assert (i, t) == (i2, t2)
        (tokens, logps), (want, want_logps) = run.completion(j2), free.completion(j)
        assert tokens == want, (i, t)
        assert (logps - want_logps).abs().max() < LOGP_TOL


PROMPTS = random_prompts([11, 23, 17, 30], 4)


def test_a_cap_holds_the_rows_and_the_fork_states_and_the_children_draw_the_same_tokens():
    free, _, free_children, _ = tree_run(engine(KVConfig()), None, PROMPTS)
    assert free.fork_prefills == 0 and run_stats(free)["fork_prefills"] == 0
    bpp = free.bytes_per_position
    prefills = []
    for cap in (2 * 128 * bpp + 40 * bpp, 4 * 128 * bpp):  # tight: most states are not kept; roomy: all are
        run, held, children, _ = tree_run(engine(KVConfig()), cap, PROMPTS)
        assert max(held) <= cap and run.peak_bytes <= cap, "rows and fork states together stay within the cap"
        same_children(run, children, free, free_children)
        prefills.append(run_stats(run)["fork_prefills"])
    assert prefills[0] > prefills[1] >= 0 and prefills[0] <= len(free_children)


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


def test_a_state_gives_way_before_a_lone_sequence_is_cut_and_its_child_prefills(released):
    """Under 258 positions, a row of 128 slots and the state before the path's least likely token (at position
    20 of 60, prompt 100: 120 positions) fit; when the row grows to 160 slots at position 28, the state is
    released, not the sequence cut; the child that needed it prefills its prompt and prefix and draws what it
    draws from the state."""
    prompt = [random_prompts([100], 9)[0]]
    free, _, free_children, _ = tree_run(engine(KVConfig()), None, prompt, new=60, forks=1)
    assert [t for _, t, _ in free_children] == [20]
    run, held, children, stats = tree_run(engine(KVConfig()), 258 * bytes_per_position(), prompt, 60, 1)
    assert released == ["_preempt"] and stats.cap_truncated == 0 and stats.preemptions == 0
    assert run.fork_prefills == 1 and free.fork_prefills == 0
    same_children(run, children, free, free_children)


def test_states_give_way_when_nothing_runs_and_the_next_sequence_does_not_fit_beside_them(released):
    """The only running sequence finished with its states filling the cap: the waiting one is admitted once a
    state is released (the run neither stalls nor fails)."""
    e, bpp = engine(KVConfig()), bytes_per_position()
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


def given_states_run(e):
    """A first run's parents keep two states each; the children of a second run start one from each (states
    it is given, made elsewhere: as SPEC-RL's drafts at their cuts are). Returns both runs and the states."""
    prompts = random_prompts([11, 23], 4)
    parents = [Request(p, key=j, seed=5, max_new_tokens=NEW, snapshots=FORKS) for j, p in enumerate(prompts)]
    first, _, _ = Scheduler(e).run(parents, Sampling())
    pairs = [(i, s) for i in range(len(parents)) for s in first.snapshots.states(i)]
    children = [
        Request(prompts[i], 50 + j, 5, NEW, first.completion(i)[0][: s.position], fork=s, fork_of=(5, i, j))
        for j, (i, s) in enumerate(pairs)
    ]
    return first, children, [s for _, s in pairs]


def test_the_states_a_run_is_given_count_in_its_peak_and_in_the_dense_yardstick():
    """Held from the run's start to its end, they are the run's KV memory: a dense run given states peaks at
    its rows and the states, and its yardstick counts them too (no saving claimed)."""
    e = engine(KVConfig())
    _, children, states = given_states_run(e)
    copies = [Request(r.prompt, r.key, r.seed, NEW, r.prefix) for r in children]
    plain, _, _ = Scheduler(e).run(copies, Sampling())
    run, _, _ = Scheduler(e).run(children, Sampling())
    assert len(run.snapshots.given) == len(states) == len(children) and run.fork_prefills == 0
    given = sum(s.nbytes for s in states)
    assert given > 0 and run.states_bytes() == given
    assert run.peak_bytes == run.dense_bytes >= given + run.cache.capacity * run.bytes_per_position
    assert plain.peak_bytes == plain.dense_bytes < run.dense_bytes


def test_a_run_given_more_states_than_the_cap_holds_releases_them_at_its_start():
    e, bpp = engine(KVConfig()), bytes_per_position()
    _, children, states = given_states_run(e)
    free, _, _ = Scheduler(e).run(children, Sampling())
    free_tokens = [free.completion(j) for j in range(len(children))]
    _, children, states = given_states_run(e)
    cap = sum(s.nbytes for s in states) - bpp  # every state fits alone, not all of them
    run, unfinished, _ = Scheduler(e, cap).run(children, Sampling())
    assert not unfinished and run.peak_bytes <= cap and 0 < run.fork_prefills < len(children)
    for j, (want, want_logps) in enumerate(free_tokens):
        tokens, logps = run.completion(j)
        assert tokens == want and (logps - want_logps).abs().max() < LOGP_TOL


def test_a_spent_given_state_is_released_first():
    """A given state no waiting request starts from goes first, however small; then the largest."""
    e = engine(KVConfig())
    _, children, states = given_states_run(e)
    run = e.start_run(children, Sampling())
    spent, rest = states[0], states[1:]
    needed = {id(s) for s in rest}
    assert spent.nbytes < max(s.nbytes for s in rest)  # the prompts are 11 and 23 tokens long
    assert run.snapshots.release_one(needed, set()) is spent and spent.cache is None
    largest = max(rest, key=lambda s: (s.nbytes, s.position))
    assert run.snapshots.release_one(needed, set()) is largest
    assert run.states_bytes() == sum(s.nbytes for s in states if s.held) > 0


@pytest.mark.parametrize("name", sorted(KVS))
def test_a_rows_bytes_are_what_its_snapshot_holds(name):
    """The room check weighs a state before making it (`KVCache.row_bytes`): the same bytes, for every cache."""
    e = engine(KVS[name])
    with e.decoding():
        run = e.start_run(
            [Request(p, key=j, seed=1, max_new_tokens=20) for j, p in enumerate(PROMPTS)], Sampling()
        )
        run.admit(list(range(len(PROMPTS))))
        for _ in range(9):
            run.step()
        for row in range(run.cache.rows):
            assert run.cache.row_bytes(row) == run.cache.row_snapshot(row).nbytes() > 0


def test_a_finished_samples_state_that_no_request_waits_for_is_released_before_a_larger_one():
    """The states of a finished sample serve children admitted already or a later run: they give way first."""
    first, _, states = given_states_run(engine(KVConfig()))
    small, large = first.snapshots.states(0), first.snapshots.states(1)  # prompts of 11 and 23 tokens
    assert max(s.nbytes for s in small) < max(s.nbytes for s in large)  # the largest is sample 1's
    assert first.snapshots.release_one(set(), {0}) in small
    assert first.snapshots.release_one({id(s) for s in small}, {0}) in large  # waited for: the largest
