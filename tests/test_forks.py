"""Forks without a prefill (engine/forks.py): a sample keeps its states before its least likely tokens, and a
request started from one continues from there. Started on the parent's own stream, a fork draws the parent's
tokens again, token for token, for the dense cache, every deterministic eviction method, block_topk and a
quantized cache; on its own stream it matches a re-prefilled child on a dense cache (and an int8 one, within
the quantization's tolerance)."""

from __future__ import annotations

import pytest
import torch
from test_eviction import engine, random_prompts

from sparserl.engine import EVICTION_METHODS, KVConfig
from sparserl.engine.decoding import Request, Sampling

LOGP_TOL = 1e-4  # a forked row's cache was written by decode steps, a re-prefilled one by a prefill: ~1e-6
# int8 beside other rows vs alone: the batch changes a float sum by ~1e-7, enough to move a query or key across
# a rounding boundary, one code step; measured up to 5e-4 on an Intel Xeon (under 1e-4 on an AMD EPYC)
QUANT_LOGP_TOL = 2e-3


def logp_tol(kv: KVConfig) -> float:
    """A fork's log-prob tolerance against a run of other rows: the quantization's for a quantized cache."""
    return QUANT_LOGP_TOL if kv.quant != "none" else LOGP_TOL


KVS = {
    "dense": KVConfig(),
    **{
        m: KVConfig(method=m, budget=14, window=3, interval=3)
        for m in sorted(EVICTION_METHODS)
        if m != "random"
    },
    "block_topk": KVConfig(method="block_topk", budget=16, page_size=4, dense_layers=[0]),
    "rkv-int8": KVConfig(method="rkv", budget=14, window=3, interval=3, quant="int8"),
}


def decode(e, requests: list[Request]):
    with e.decoding():
        run = e.start_run(requests, Sampling())
        run.admit(list(range(len(requests))))
        while run.running:
            run.step()
    return run


def fork_points(logps: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(logps)), key=lambda t: (logps[t], t))[:k])


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("name", sorted(KVS))
def test_a_fork_on_the_parents_stream_draws_the_parents_tokens_again(name, group):
    """In a run of their own, after the parents' run ended; with groups of two parents a prompt, the states
    read their prompt held once where the cache shares prompts, and so do the children."""
    assert_forks_draw_the_parents_tokens(engine(KVS[name]), name, group)


def assert_forks_draw_the_parents_tokens(e, name: str, group: int, tol: float = LOGP_TOL) -> None:
    """The test above on engine `e`, log-probs within `tol` (tests/test_cuda.py runs it on a GPU)."""
    prompts = random_prompts([11, 23], 4) * group
    parents = [Request(p, key=j, seed=5, max_new_tokens=24, snapshots=2) for j, p in enumerate(prompts)]
    first = decode(e, parents)
    children = []
    for i, parent in enumerate(parents):
        tokens, logps = first.completion(i)
        snaps = sorted(first.snapshots.kept[i], key=lambda s: s.position)
        assert [s.position for s in snaps] == fork_points(logps.tolist(), 2)  # the tree's rule
        if name == "dense":  # the state holds its own slots only when the prompt is held once
            assert all(
                int(s.cache.length[0]) == s.position + len(parent.prompt) * (group == 1) for s in snaps
            )
            assert all((s.reads is not None) == (group == 2) for s in snaps)
        for s in snaps:
            children.append((i, s.position, Request(parent.prompt, parent.key, parent.seed, 24,
                                                    tokens[: s.position], fork=s)))  # fmt: skip
    prefilled = []
    e.prefilled = lambda inputs, *a: prefilled.append(inputs)  # any prefill would fail here
    second = decode(e, [r for _, _, r in children])
    assert not prefilled
    for j, (i, t, _) in enumerate(children):
        tokens, logps = first.completion(i)
        got, got_logps = second.completion(j)
        assert got == tokens[t:], (name, i, t)
        assert (got_logps - logps[t:]).abs().max() < tol


# Caches that hold every position, with the log-prob tolerance of a re-prefilled child against a fork: a prefill
# attends to full-precision keys and values where the parent's decode steps read int8 codes (measured: 0.034 at
# most over 20 tokens). Evicting caches and block_topk are not here: a re-prefilled child holds or reads other
# positions than its parent did (its prefill reads all of them), so it draws other tokens (block_topk: from the
# first); a fork continues what the parent held, as the test above shows for every method.
REPREFILL_KVS = {"dense": (KVConfig(), LOGP_TOL), "int8": (KVConfig(quant="int8"), 0.1)}


@pytest.mark.parametrize("name", sorted(REPREFILL_KVS))
def test_a_fork_on_its_own_stream_matches_a_re_prefilled_child(name):
    kv, tol = REPREFILL_KVS[name]
    e = engine(kv)
    prompt = random_prompts([17], 9)[0]
    first = decode(e, [Request(prompt, key=0, seed=1, max_new_tokens=20, snapshots=1)])
    snap = first.snapshots.kept[0][0]
    prefix = first.completion(0)[0][: snap.position]
    forked = decode(e, [Request(prompt, key=7, seed=2, max_new_tokens=20, prefix=prefix, fork=snap)])
    again = decode(e, [Request(prompt, key=7, seed=2, max_new_tokens=20, prefix=prefix)])
    assert forked.completion(0)[0] == again.completion(0)[0]
    assert (forked.completion(0)[1] - again.completion(0)[1]).abs().max() < tol


def test_a_fork_whose_prefix_disagrees_with_its_snapshot_is_refused():
    e = engine(KVConfig())
    prompt = random_prompts([9], 2)[0]
    snap = decode(e, [Request(prompt, key=0, seed=1, max_new_tokens=8, snapshots=1)]).snapshots.kept[0][0]
    with pytest.raises(ValueError, match="forked at completion position"):
        decode(
            e, [Request(prompt, key=0, seed=1, max_new_tokens=8, prefix=[5] * (snap.position + 1), fork=snap)]
        )


def test_a_snapshot_holds_only_the_slots_its_row_held():
    e = engine(KVConfig(method="rkv", budget=14, window=3, interval=3))
    run = decode(e, [Request(random_prompts([30], 3)[0], key=0, seed=1, max_new_tokens=20, snapshots=1)])
    snap = run.snapshots.kept[0][0]
    assert snap.cache.rows == 1 and snap.cache.capacity == int(snap.cache.length[0]) <= 14 + 3 - 1
    assert torch.isfinite(snap.logits).all()


def decode_growing(e, requests: list[Request], children_of) -> tuple:
    """A run that admits what `children_of(run, i)` returns as sample i finishes (DecodeRun.extend), as the
    scheduler does for a tree's children; returns the run and the ids each finished sample added."""
    added = {}
    with e.decoding():
        run = e.start_run(requests, Sampling())
        run.admit(list(range(len(requests))))
        while run.running:
            for i in run.step():
                added[i] = run.extend(more) if (more := children_of(run, i)) else []
                run.admit(added[i])
    return run, added


@pytest.mark.parametrize("name", sorted(KVS))
def test_a_fork_joining_its_parents_run_draws_what_it_draws_in_a_run_of_its_own(name):
    """Children forked from their parent's state as it finishes, in the parent's run beside the samples still
    decoding (two more per prompt reading it held once where the cache shares prompts), draw on the parent's
    stream the parent's tokens again, and on their own stream what they draw in a run of their own; the readers
    draw what they draw without the children."""
    e = engine(KVS[name])
    prompts = random_prompts([11, 23], 4)
    parents = [Request(p, key=j, seed=5, max_new_tokens=24, snapshots=2) for j, p in enumerate(prompts * 2)]
    readers = [Request(p, key=50 + j, seed=5, max_new_tokens=30) for j, p in enumerate(prompts * 2)]

    def children_of(run, i):
        tokens = run.completion(i)[0]
        return [Request(parents[i].prompt, key, parents[i].seed, 24, tokens[: s.position], fork=s)
                for s in run.snapshots.kept.get(i, ()) for key in (parents[i].key, 100 + i)]  # fmt: skip

    run, added = decode_growing(e, parents + readers, children_of)
    assert sorted(added) == list(range(8 + 8 * 2))  # every child joined and finished in the run
    by_themselves = decode(e, readers)
    assert [run.completion(4 + j)[0] for j in range(4)] == [by_themselves.completion(j)[0] for j in range(4)]
    for i in range(len(parents)):
        tokens, logps = run.completion(i)
        for same, own in zip(added[i][::2], added[i][1::2], strict=True):
            t = len(run.requests[same].prefix)
            assert run.completion(same)[0] == tokens[t:], (name, i, t)
            assert (run.completion(same)[1] - logps[t:]).abs().max() < LOGP_TOL
            alone = decode(e, [run.requests[own]])
            assert run.completion(own)[0] == alone.completion(0)[0], (name, i, t)
            assert (run.completion(own)[1] - alone.completion(0)[1]).abs().max() < logp_tol(KVS[name])


def test_a_longer_request_joining_a_run_draws_what_it_draws_alone():
    """A request with more new tokens than the run's joins it (its draws and every sample's records widened)
    and draws what it draws in a run of its own; the samples already there are unchanged."""
    e = engine(KVConfig())
    prompts = random_prompts([9, 14, 20], 6)
    base = [Request(p, key=j, seed=3, max_new_tokens=12) for j, p in enumerate(prompts)]
    longer = Request(prompts[1], key=50, seed=4, max_new_tokens=40, prefix=[5, 6])
    run, added = decode_growing(e, base, lambda run, i: [longer] if i == 0 else None)
    (j,) = added[0]
    assert run.completion(j)[0] == decode(e, [longer]).completion(0)[0] and len(run.requests) == 4
    plain = decode(e, base)
    assert [run.completion(i)[0] for i in range(3)] == [plain.completion(i)[0] for i in range(3)]


@pytest.mark.parametrize("group", [1, 3])
def test_a_runs_peak_kv_bytes_count_the_fork_states_it_keeps(group):
    """Fork states are keys and values too: a run that keeps them peaks at least their bytes above the same run
    without them (the same cache), and the dense engine's yardstick counts the states it would keep. In a group
    the states read the prompt held once: they hold their own positions only, the prompt counted once."""
    e = engine(KVConfig())
    prompt = random_prompts([25], 4)[0]
    keeping, plain = (
        decode(e, [Request(prompt, key=j, seed=1, max_new_tokens=30, snapshots=k) for j in range(group)])
        for k in (3, 0)
    )
    kept = [s for i in range(group) for s in keeping.snapshots.kept[i]]
    assert len(kept) == 3 * group and keeping.snapshots.nbytes == sum(s.nbytes for s in kept) > 0
    own = sum(s.position + len(prompt) * (group == 1) for s in kept)
    assert keeping.snapshots.nbytes == own * keeping.bytes_per_position
    assert keeping.peak_bytes >= plain.peak_bytes + keeping.snapshots.nbytes
    # the dense yardstick keeps them too: a dense run that keeps states peaks at its yardstick, no saving claimed
    assert keeping.peak_bytes == keeping.dense_bytes > plain.dense_bytes == plain.peak_bytes


def test_states_keep_the_prompt_they_read_after_its_last_reader_finished():
    """The states of a group's finished samples keep its prompt held once: counted beside the cache once no
    row reads it, and held again by the run a child joins."""
    e = engine(KVConfig())
    prompt = random_prompts([25], 4)[0]
    run = decode(e, [Request(prompt, key=j, seed=1, max_new_tokens=10, snapshots=2) for j in range(2)])
    reads = run.snapshots.kept[0][0].reads
    assert not run.cache.holds(reads.prefix) and not run.cache.prefixes
    assert run.snapshots.bytes_beside(run.cache) == run.snapshots.nbytes + reads.prefix.nbytes()
    assert len({id(s.reads.prefix) for i in range(2) for s in run.snapshots.kept[i]}) == 1


def test_a_dense_tree_run_that_grows_claims_no_saving():
    """Two children of each state join a dense group's run as their parent finishes (copies of the state's row,
    reading the group's prompt): they draw what they should, and the run's peak is its dense yardstick."""
    e = engine(KVConfig())
    prompt = random_prompts([21], 4)[0]
    parents = [Request(prompt, key=j, seed=5, max_new_tokens=24, snapshots=1) for j in range(2)]

    def children_of(run, i):
        tokens = run.completion(i)[0]
        return [Request(prompt, key, 5, 24, tokens[: s.position], fork=s)
                for s in run.snapshots.kept.get(i, ()) for key in (parents[i].key, 100 + i)]  # fmt: skip

    run, added = decode_growing(e, parents, children_of)
    for i in range(2):
        tokens, logps = run.completion(i)
        same, own = added[i]
        t = len(run.requests[same].prefix)
        assert run.completion(same)[0] == tokens[t:]
        assert (run.completion(same)[1] - logps[t:]).abs().max() < LOGP_TOL
        assert run.completion(own)[0] == decode(e, [run.requests[own]]).completion(0)[0]
    assert run.peak_bytes == run.dense_bytes


def test_the_yardsticks_states_read_the_prompt_the_dense_engine_holds_once():
    """A quantized cache copies prompts, so its states hold theirs; the dense engine would hold a group's prompt
    once and its states would read it: the yardstick counts their positions only (no saving invented)."""
    e = engine(KVConfig(quant="int8"))
    prompt = random_prompts([25], 4)[0]
    run = decode(e, [Request(prompt, key=j, seed=1, max_new_tokens=30, snapshots=2) for j in range(3)])
    kept = [s for i in range(3) for s in run.snapshots.kept[i]]
    assert all(s.reads is None and int(s.cache.length[0]) == len(prompt) + s.position for s in kept)
    assert run.snapshots.dense_positions == sum(s.position for s in kept)
    alone = decode(e, [Request(prompt, key=0, seed=1, max_new_tokens=30, snapshots=2)])
    assert alone.snapshots.dense_positions == sum(len(prompt) + s.position for s in alone.snapshots.kept[0])


def test_a_request_with_nothing_left_to_draw_is_refused_by_name():
    with pytest.raises(ValueError, match="request 7: its 8 given completion tokens leave nothing to draw"):
        Request([5, 6], key=7, seed=1, max_new_tokens=8, prefix=[1] * 8)
