"""Tree rollouts and TreeRL's advantages: the estimator on a hand-built tree, trees grown on a scripted backend
(sizes, shared prefixes, fork points, fresh streams), and a tiny-model run with the tree transform."""

from __future__ import annotations

import pytest
import torch

from sparserl.algo.tree import tree_advantages
from sparserl.config import load_config
from sparserl.config.errors import ConfigError
from sparserl.rollout import (
    RolloutBackend,
    RolloutLayer,
    Segment,
    SourceContext,
    check_group_sources,
    make_group_source,
)
from sparserl.rollout.records import SampleRecord
from sparserl.rollout.tree import fork_points
from tests.test_trainer import make_trainer, rows, tiny_cfg


def test_tree_advantages_on_a_hand_built_tree():
    """Depth 2, 4 leaves, rewards [1, 0, 0, 0]: V(root) = 1/4, V([1, 2]) = 1/2, V([1, 3]) = 0; a token's
    advantage is (V - V_root) + (V - V_parent segment)."""
    tokens = [[1, 2, 4], [1, 2, 5], [1, 3, 6], [1, 3, 7]]
    got = tree_advantages(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), tokens)
    want = [[0, 0.5, 1.25], [0, 0.5, -0.75], [0, -0.5, -0.25], [0, -0.5, -0.25]]
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-7)
    flat = tree_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), tokens)
    assert torch.equal(flat, torch.zeros(4, 3))  # constant rewards: no signal anywhere


def test_independent_samples_get_twice_their_grpo_baseline_everywhere():
    tokens = [[1, 9], [2], [3, 8, 7]]
    got = tree_advantages(torch.tensor([1.0, 0.0, 0.5]), torch.zeros(3, dtype=torch.long), tokens)
    assert got[0].tolist() == [1.0, 1.0, 0.0] and got[1].tolist() == [-1.0, 0.0, 0.0]  # past the end: 0
    assert torch.allclose(got[2], torch.zeros(3))  # reward 0.5 = the mean


def test_fork_points_are_the_paths_most_uncertain_own_tokens():
    s = SampleRecord(0, 0, 0, 0, 0, tokens=[1, 2, 3, 4, 5], sampler_logps=[-9.0, -0.1, -3.0, -0.2, -3.0])
    assert fork_points(s, 2) == [0, 2]
    s.reused_prefix = 1  # an inherited prefix is not the path's own
    assert fork_points(s, 2) == [2, 4]


class KeyedBackend(RolloutBackend):
    """Four tokens per sample from its (seed, key), decreasing log-probs; the prefix is kept."""

    name = "keyed_tree"

    def run(self, requests, sampling, version, seed, on_segment, stop=None):
        for i, r in enumerate(requests):
            need = 6 - len(r.prefix)
            tokens = [(r.key * 7 + t * 13 + r.seed) % 101 + 1 for t in range(need)]
            on_segment(Segment(i, tokens, [-0.1 * (t + 1) for t in range(need)], "length", version))
        return {}

    def score(self, prompts, completions, temperature):
        return [[-0.5] * len(c) for c in completions]


class View:
    def prompt_ids(self, row):
        return [1, row]

    def example(self, row):
        return row

    def decode(self, ids):
        return [" ".join(map(str, t)) for t in ids]

    def scores(self, texts, examples):
        return [float(len(t) % 2) for t in texts]


def test_trees_grow_by_their_closed_form_and_share_prefixes():
    cfg = load_config(None, ["rollout.tree.enable=true", "rollout.n=3", "rollout.tree.forks=2",
                             "rollout.tree.children=2", "rollout.tree.rounds=2", "rollout.max_new_tokens=6"])  # fmt: skip
    source = make_group_source(SourceContext(list(range(10)), 3, 0, cfg))
    layer = RolloutLayer(KeyedBackend(), View(), cfg.rollout, cfg.sampling.max_extra_rounds)
    got = layer.collect_step(source, 2, 0, 5)
    for g in got.groups:
        # roots M = 3; round 1: M x T x N = 12 children; round 2: N x min(T, own tokens) per child
        second = sum(2 * min(2, 6 - c.reused_prefix) for c in g.samples[3:15])
        assert len(g.samples) == 3 + 12 + second and second == 36  # forks at 4 and 5: 2 or 1 own tokens left
        assert len({s.key for s in g.samples}) == len(g.samples)  # every path its own stream
        roots = g.samples[:3]
        for child in g.samples[3:15]:
            parent = roots[(child.sample_index - 3) // 4]
            assert child.tokens[: child.reused_prefix] == parent.tokens[: child.reused_prefix]
            assert child.sampler_logps[: child.reused_prefix] == parent.sampler_logps[: child.reused_prefix]
            assert child.prefix_origin == "forked" and child.reused_prefix in fork_points(parent, 2)
    assert got.sampling["rounds"] == 3  # a backend that does not grow its runs: one run per forking round
    drawn = got.sampling["generated_tokens"]
    assert drawn == sum(len(s.tokens) - s.reused_prefix for g in got.groups for s in g.samples) < 2 * 63 * 6


def test_a_tree_run_trains_with_the_tree_transform(tmp_path):
    extra = ("rollout.tree.enable=true", "rollout.n=2", "rollout.tree.forks=1", "algo.adv_transforms=[tree]",
             "trainer.steps=2", "optim.mini_batch_size=0")  # fmt: skip
    trainer = make_trainer(tiny_cfg(tmp_path, *extra))
    trainer.train()
    logged = [r for r in rows(tmp_path / "run") if "sampling/tree_leaves" in r]
    assert len(logged) == 2 and all(r["sampling/tree_leaves"] == 2 + 2 * 1 * 2 for r in logged)
    assert all(r["adv/abs_mean"] == r["adv/abs_mean"] for r in logged)  # finite


def test_tree_rounds_need_rounds_of_the_step():
    with pytest.raises(
        ConfigError, match=r"rollout.tree.enable=true \(3 extra rounds\) needs sampling.max_extra_rounds >= 3"
    ):
        check_group_sources(
            load_config(
                None, ["rollout.tree.enable=true", "rollout.tree.rounds=3", "sampling.max_extra_rounds=2"]
            )
        )


@pytest.mark.parametrize("kv", [["kv.method=dense", "algo.preset=dense"], []], ids=["dense", "rkv"])
def test_children_start_from_their_parents_state_without_a_prefill(tmp_path, kv):
    """Two forking rounds on the local backend: every child starts from the state its parent kept at the fork
    point (no prefill after the roots'), in its parent's run (one round: the local backend grows its runs),
    and on a dense cache its tokens are those a re-prefilled child draws."""
    extra = ("rollout.tree.enable=true", "rollout.n=2", "rollout.tree.forks=2", "rollout.tree.children=1",
             "rollout.tree.rounds=2", "sampling.max_extra_rounds=2", *kv)  # fmt: skip
    trainer = make_trainer(tiny_cfg(tmp_path, *extra))
    engine = trainer.rollouts.backend.engine
    prefilled, prefill = [], engine.prefilled
    engine.prefilled = lambda inputs, *a: prefilled.append(len(inputs)) or prefill(inputs, *a)
    got = trainer.rollouts.collect_step(trainer.source, 2, 0, 5)
    children = [s for g in got.groups for s in g.samples if s.prefix_origin == "forked"]
    assert len(children) > 2 * 2 * 2 and all(c.fork_of is not None for c in children)  # both rounds forked
    assert prefilled == [2]  # the two prompts, once, for the roots
    assert got.sampling["rounds"] == 1 and got.metrics["admissions"] == len(children) + 2 * 2
    for g in got.groups:  # every root and every child of a root forked at min(2, its own tokens) points
        roots = {s.key: s for s in g.samples[:2]}
        first = [s for s in g.samples if s.fork_of is not None and s.fork_of[1] in roots]
        own = sum(min(2, len(s.tokens) - s.reused_prefix) for s in [*roots.values(), *first])
        assert len(g.samples) == 2 + own
    if kv:  # dense: a child prefilled from its prompt and prefix draws the same tokens
        from sparserl.engine.decoding import Request, Sampling

        reqs = [Request(trainer.train_view.prompt_ids(c.prompt_id), c.key, c.seed, trainer.cfg.rollout.max_new_tokens,
                        c.tokens[: c.reused_prefix]) for c in children]  # fmt: skip
        with engine.decoding():
            run = engine.start_run(reqs, Sampling())
            run.admit(list(range(len(reqs))))
            while run.running:
                run.step()
        assert [run.requests[i].prefix + run.completion(i)[0] for i in range(len(reqs))] == [
            c.tokens for c in children
        ]


def test_a_tree_draws_the_same_paths_in_its_parents_run_under_a_cap_or_in_rounds(tmp_path):
    """Every path draws the same tokens whether its children join the parents' run (the local backend), under a
    KV memory cap that preempts (none refused as too large for the cap), or run in rounds of their own (a
    backend that keeps rounds): a child's stream is its parent's key, fork point and number, not its place."""
    extra = (
        "rollout.tree.enable=true",
        "rollout.n=2",
        "rollout.tree.forks=2",
        "rollout.tree.children=1",
        "rollout.tree.rounds=2",
        "sampling.max_extra_rounds=2",
        "kv.method=dense",
        "algo.preset=dense",
        "rollout.max_new_tokens=160",
    )  # fmt: skip  (rows outgrow a block of 128 positions: the cap preempts)
    paths, rounds, preempted = {}, {}, {}
    for arm, cap in (("run", "none"), ("capped", "300KiB"), ("rounds", "none")):
        trainer = make_trainer(tiny_cfg(tmp_path / arm, *extra, f"rollout.kv_memory_cap={cap}"))
        trainer.rollouts.backend.grows_runs = arm != "rounds"
        got = trainer.rollouts.collect_step(trainer.source, 2, 0, 5)
        paths[arm] = {s.key: s.tokens for g in got.groups for s in g.samples}
        rounds[arm], preempted[arm] = got.sampling["rounds"], got.metrics["preemptions"]
        trainer.close()
    assert rounds == {"run": 1, "capped": 1, "rounds": 3} and preempted["capped"] > 0
    assert paths["capped"] == paths["run"] == paths["rounds"] and len(paths["run"]) > 2 * 2 * 3


def test_a_ray_worker_keeps_its_finished_paths_states_for_the_next_round(tmp_path):
    """A Ray worker's runs never grow (the driver plans a tree's children for a later round), so it keeps the
    states of the paths it finished, for the weights that made them: a child sent to it in the next round starts
    from its parent's state, no prefill, and draws what the parent's own run would have drawn there."""
    from sparserl.engine.decoding import Request, Sampling
    from sparserl.engine.run_settings import engine_settings
    from sparserl.rollout.ray_backend import RolloutWorker

    cfg = tiny_cfg(tmp_path, "kv.method=dense", "algo.preset=dense")
    trainer = make_trainer(cfg)
    engine = trainer.rollouts.backend.engine
    worker = RolloutWorker(
        engine.model, engine.tokenizer, engine_settings(cfg, engine.model)[0], cfg.rollout, 1
    )
    trainer.close()
    assert not worker.backend.grows_runs
    worker.backend.push_weights(3)
    prompt = [5, 9, 11, 7]
    parents, _ = worker.run(
        [Request(prompt, key=1, seed=2, max_new_tokens=12, snapshots=1)], Sampling(), 3, 0
    )
    (t,) = fork_points(SampleRecord(0, 0, 0, 2, 1, parents[0].tokens, parents[0].logps), 1)
    child = Request(prompt, key=1, seed=2, max_new_tokens=12, prefix=parents[0].tokens[:t], fork_of=(2, 1, t))
    prefills = []
    prefilled = worker.backend.engine.prefilled
    worker.backend.engine.prefilled = lambda *a: prefills.append(a) or prefilled(*a)
    (again,), _ = worker.run([child], Sampling(), 3, 0)
    assert not prefills and again.tokens == parents[0].tokens[t:]
