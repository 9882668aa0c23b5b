"""Forks without a prefill (engine/forks.py): a sample keeps its states before its least likely tokens, and a
request started from one continues from there. Started on the parent's own stream, a fork draws the parent's
tokens again, token for token, for the dense cache, every deterministic eviction method, block_topk and a
quantized cache; on its own stream it matches a re-prefilled child on a dense cache."""

from __future__ import annotations

import pytest
import torch
from test_eviction import engine, random_prompts

from sparserl.engine import EVICTION_METHODS, KVConfig
from sparserl.engine.decoding import Request, Sampling

LOGP_TOL = 1e-4  # a forked row's cache was written by decode steps, a re-prefilled one by a prefill: ~1e-6
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


@pytest.mark.parametrize("name", sorted(KVS))
def test_a_fork_on_the_parents_stream_draws_the_parents_tokens_again(name):
    e = engine(KVS[name])
    prompts = random_prompts([11, 23], 4)
    parents = [Request(p, key=j, seed=5, max_new_tokens=24, snapshots=2) for j, p in enumerate(prompts)]
    first = decode(e, parents)
    children = []
    for i, parent in enumerate(parents):
        tokens, logps = first.completion(i)
        snaps = sorted(first.snapshots.kept[i], key=lambda s: s.position)
        assert [s.position for s in snaps] == fork_points(logps.tolist(), 2)  # the tree's rule
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
        assert (got_logps - logps[t:]).abs().max() < LOGP_TOL


def test_a_fork_on_its_own_stream_matches_a_re_prefilled_child_on_a_dense_cache():
    e = engine(KVConfig())
    prompt = random_prompts([17], 9)[0]
    first = decode(e, [Request(prompt, key=0, seed=1, max_new_tokens=20, snapshots=1)])
    snap = first.snapshots.kept[0][0]
    prefix = first.completion(0)[0][: snap.position]
    forked = decode(e, [Request(prompt, key=7, seed=2, max_new_tokens=20, prefix=prefix, fork=snap)])
    again = decode(e, [Request(prompt, key=7, seed=2, max_new_tokens=20, prefix=prefix)])
    assert forked.completion(0)[0] == again.completion(0)[0]
    assert (forked.completion(0)[1] - again.completion(0)[1]).abs().max() < LOGP_TOL


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
