"""The second review's fixes: a NaN sampler log-prob skipped under every preset, TIS batch normalisation per
micro-batch (what docs/architecture.md says), uniqueness judged on the task reward, token-level advantages
whitened and logged without their padding, GSPO with token-mean warned about, a SAPO pool named per swarm, a
replaced worker caught up without the broadcast group, rollout throughput over the rounds' time, SPEC-RL with
APRIL caching only what the current weights drew (FSDP with a short mini-batch: tests/test_fsdp_variable_batch.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer, rows, tiny_cfg, weights

from sparserl.config import ConfigError, load_config
from sparserl.trainer.update import Learner

# ---------------------------------------------------------------- the learner


@pytest.mark.parametrize(
    "rules",
    [
        ["algo.preset=sparse-rl"],
        ["algo.preset=dense", "kv.method=dense"],
        ["algo.preset=smd"],
        ["algo.preset=geo-rs"],
        ["algo.correction_mode=bypass"],
    ],
)
def test_a_nan_sampler_log_prob_is_skipped_and_counted_under_every_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rules: list[str]
) -> None:
    real = Learner.update

    def poisoned(self, step, batch):
        if step == 1:
            batch.logp_sampler[0, :] = float("nan")
        return real(self, step, batch)

    monkeypatch.setattr(Learner, "update", poisoned)
    trainer = make_trainer(tiny_cfg(tmp_path, "optim.mini_batch_size=0", "trainer.steps=2", *rules))
    trainer.train()
    logged = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["train/nonfinite_skipped_updates"] for r in logged] == [1.0, 0.0]
    assert all(torch.isfinite(v).all() for v in weights(trainer).values())


def test_tis_batch_normalisation_is_per_micro_batch_so_the_update_depends_on_grad_accum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What docs/architecture.md says: under sparse-rl the IS weights are divided by their mean over each
    micro-batch, so 1 and 4 micro-batches give other gradients; without that normalisation the same."""
    from test_update import TIGHT, _captured_gradient

    def gradients(grad_accum: int, *extra: str) -> list[torch.Tensor]:
        return _captured_gradient(tmp_path, grad_accum, monkeypatch, "algo.preset=sparse-rl", *TIGHT, *extra)

    one, four = gradients(1), gradients(4)
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(one, four, strict=True))
    one, four = gradients(1, "algo.tis_batch_norm=false"), gradients(4, "algo.tis_batch_norm=false")
    for a, b in zip(one, four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------- advantages


def test_uniqueness_judges_correct_on_the_task_reward_before_the_overlong_penalty() -> None:
    """The singleton strategy is right but overlong: its penalty of -1 brings its reward to 0, and it must still
    count as a correct rollout with a cluster of its own."""
    from test_uniqueness import GROUP, REWARDS, transform

    from sparserl.algo import AlgoConfig, advantages_from_config

    shaped = REWARDS.clone()
    shaped[4] -= 1.0  # the singleton, overlong
    uniqueness = transform()
    advantages_from_config(shaped, [0] * 8, AlgoConfig(), GROUP, [uniqueness], task_rewards=REWARDS)
    assert uniqueness.metrics()["clusters_per_group"] == 2.0  # the majority's and the singleton's


def test_token_level_advantages_are_whitened_and_logged_without_their_padding() -> None:
    from types import SimpleNamespace

    from sparserl.algo import AlgoConfig
    from sparserl.algo.advantages import BatchWhiten, TransformContext
    from sparserl.trainer.logging import sample_metrics

    tokens = [[5, 6, 7], [8]]
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])  # the second row is padded after one token
    out = BatchWhiten(TransformContext(AlgoConfig(adv_eps=0.0)))(
        adv, torch.zeros(2), torch.arange(2), [], tokens
    )
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (values - values.mean()) / values.std()
    torch.testing.assert_close(out[0], expected[:3])
    torch.testing.assert_close(out[1, 0], expected[3])
    assert torch.equal(out[1, 1:], torch.zeros(2))  # padding stays padding
    samples = [
        SimpleNamespace(reward=1.0, sampler_logps=[-1.0] * len(t), tokens=t, finish_reason="eos")
        for t in tokens
    ]
    assert sample_metrics(samples, adv)["adv/abs_mean"] == pytest.approx(10 / 4)


# ---------------------------------------------------------------- config


def test_gspo_with_token_mean_is_warned_about() -> None:
    with pytest.warns(UserWarning, match=r"algo.policy_loss='gspo' takes one ratio per sequence"):
        load_config(None, ["algo.preset=gspo", "algo.loss_agg_mode=token-mean"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["algo.preset=gspo"])  # seq-mean-token-mean: the paper's
        load_config(None, ["algo.preset=dapo"])  # token-mean with a token-level ratio


def test_a_swarm_must_name_its_pool() -> None:
    """The pool is a detached actor that outlives the runs: a shared default name would hand a later swarm on
    the same cluster an earlier one's groups."""
    with pytest.raises(
        ConfigError, match=r"distributed.swarm.pool='' must name the pool actor, one name per swarm"
    ):
        load_config(None, ["distributed.swarm.enable=true"])
    load_config(None, ["distributed.swarm.enable=true", "distributed.swarm.pool=exp1-seed0"])
    load_config(None, [])  # no swarm: no name


# ---------------------------------------------------------------- rollout workers


class _Recorded:
    """A fake Ray actor: each `actor.method.remote(...)` call is recorded as (worker, method), its own ref."""

    def __init__(self, i: int, calls: list) -> None:
        self.i, self.calls = i, calls

    def __getattr__(self, method: str):
        def remote(*args):
            self.calls.append((self.i, method))
            return (self.i, method)

        return type("Method", (), {"remote": staticmethod(remote)})()


class _FakeRay:
    @property
    def util(self):  # what forming a group asks first
        raise AssertionError("a group formed while worker 0 decodes: the replacement would wait for it")

    def put(self, value):
        return value

    def get(self, refs):
        return refs


def test_a_replaced_worker_catches_up_alone_and_the_broadcast_group_is_formed_at_the_next_push() -> None:
    """Worker 0 is decoding its share when worker 1 is replaced: forming the group then would wait for worker 0
    (up to distributed.start_timeout_s). The new worker gets the version through the object store alone."""
    from sparserl.distributed.weight_sync import BroadcastSync

    calls: list = []
    sync = BroadcastSync(_FakeRay(), 0.0, 1.0)
    sync.group = object()  # formed at an earlier push
    sync.catch_up([_Recorded(0, calls), _Recorded(1, calls)], 1, 3, {"w": torch.zeros(2)})
    assert calls == [(1, "push")]
    assert sync.group is None  # the next push forms it anew with every worker


def test_rollout_throughput_of_a_steps_rounds_is_their_tokens_over_their_summed_time() -> None:
    from sparserl.rollout.backend import merge_run_metrics

    rounds = [
        {"tokens_per_s": 100.0, "generated_tokens": 100.0, "prefill_s": 0.5, "decode_s": 0.5},
        {"tokens_per_s": 50.0, "generated_tokens": 50.0, "prefill_s": 0.2, "decode_s": 0.8},
    ]
    assert merge_run_metrics(rounds, side_by_side=False)["tokens_per_s"] == pytest.approx(150 / 2.0)
    assert merge_run_metrics(rounds, side_by_side=True)["tokens_per_s"] == 150.0  # workers decode at once


def test_spec_rl_with_april_caches_only_samples_the_current_weights_drew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """APRIL trains leftovers that older weights drew in part or whole; their log-probs scored now would be
    the current weights', not those that drew them, so they are not cached as SPEC-RL drafts."""
    from test_reuse import make

    from sparserl.rollout.layer import RolloutLayer
    from sparserl.rollout.reuse import SpecReuse

    versions: list[int] = []
    cached: list[tuple[set[int], int]] = []  # each cached sample's versions and the step's
    collect, observe = RolloutLayer.collect_step, SpecReuse.observe

    def collect_step(self, source, k, version, seed, drawn_by=None):
        versions.append(version)
        return collect(self, source, k, version, seed, drawn_by)

    def watched(self, groups, leftover):
        cached.extend((set(s.versions), versions[-1]) for g in groups for s in g.samples if s.scored_logps)
        return observe(self, groups, leftover)

    monkeypatch.setattr(RolloutLayer, "collect_step", collect_step)
    monkeypatch.setattr(SpecReuse, "observe", watched)
    april = ["rollout.partial.enable=true", "rollout.partial.over_provision=2", "rollout.kv_memory_cap=64MiB"]
    ratio = "rollout.spec.acceptance=ratio"  # the rule that caches log-probs (coupled caches streams)
    make(tmp_path, *april, ratio, "optim.lr=0.05", "trainer.steps=3", "rollout.max_new_tokens=24").train()
    assert cached and all(drew == {version} for drew, version in cached)
