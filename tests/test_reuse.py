"""SPEC-RL's reuse: the acceptance rule on hand-made log-probs, fresh uniforms per step, identity under
unchanged weights (every draft accepted whole, nothing decoded), drafts continued from their cut, exact
resume with the cache in the checkpoint, and clear refusals."""

from __future__ import annotations

import math

import pytest
import torch

from sparserl.config import load_config
from sparserl.config.errors import ConfigError
from sparserl.rollout import RolloutBackend, check_group_sources
from sparserl.rollout.reuse import accepted_length, verification_uniforms
from sparserl.tasks.base import Example
from tests.test_trainer import ParityTask, Trainer, rows, tiny_cfg, weights


def test_equal_logprobs_accept_everything_whatever_the_uniforms():
    lp = [-0.1, -2.0, -5.0]
    assert accepted_length(lp, lp, [0.999999, 1e-12, 0.5]) == 3


def test_the_first_rejected_token_cuts_the_draft():
    now, then = [-1.0, -1.0, -3.0, -1.0], [-1.0, -2.0, -1.0, -1.0]
    # t=0: delta 0 accepts; t=1: delta +1 accepts; t=2: delta -2, accepted iff log u <= -2
    assert accepted_length(now, then, [0.5, 0.9, math.exp(-2.0) * 0.99, 0.9]) == 4
    assert accepted_length(now, then, [0.5, 0.9, math.exp(-2.0) * 1.01, 0.0]) == 2
    # lenience 2 lifts delta to 0 at t=2: accepted whatever u
    assert accepted_length(now, then, [0.5, 0.9, 0.99, 0.9], lenience=2.0) == 4


def test_uniforms_are_fresh_each_step_and_fixed_within_one():
    a, b = verification_uniforms(11, 5, 8), verification_uniforms(12, 5, 8)
    assert a == verification_uniforms(11, 5, 8) and a != b
    assert a != verification_uniforms(11, 6, 8)


class TwoPrompts(ParityTask):
    """Two prompts: with two groups a step, every prompt returns at every step."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Example:
        return super().__getitem__(i)


def make(tmp_path, *extra, name="run", **kw) -> Trainer:
    cfg = tiny_cfg(tmp_path, "rollout.spec.enable=true", *extra, name=name)
    return Trainer(cfg, task=TwoPrompts(), eval_task=TwoPrompts(), **kw)


@pytest.mark.parametrize("verify", ["exact", "batched"])
@pytest.mark.parametrize("acceptance", ["coupled", "ratio"])
def test_unchanged_weights_accept_every_draft_whole_and_decode_nothing(tmp_path, acceptance, verify):
    """Ratio: the drafts' log-probs are the verifier's under the same weights, whatever sampler drew them.
    Coupled: the verifier redraws on each draft's stream, so the sampler must be the dense policy itself (a
    sparse sampler's drafts are kept up to where it drew otherwise than the dense policy)."""
    spec = (f"rollout.spec.acceptance={acceptance}", f"rollout.spec.verify={verify}")
    dense = ("algo.preset=dense", "kv.method=dense") if acceptance == "coupled" else ()
    trainer = make(tmp_path, "optim.lr=0", "optim.weight_decay=0", "trainer.steps=2", *spec, *dense)
    first, _ = trainer.rollout(1)
    trainer.learn(1, first)
    trainer.state.step = 1
    second, metrics = trainer.rollout(2)
    assert metrics["sampling/spec_accepted_frac"] == 1.0 and metrics["sampling/spec_whole_frac"] == 1.0
    assert metrics["sampling/generated_tokens"] == 0
    assert sorted(map(tuple, second.completions)) == sorted(map(tuple, first.completions))
    assert bool(torch.isfinite(second.logp_sampler[second.mask]).all())


@pytest.mark.parametrize("acceptance", ["coupled", "ratio"])
def test_changed_weights_keep_the_accepted_prefix_and_sample_on(tmp_path, acceptance):
    trainer = make(tmp_path, "optim.lr=0.05", "trainer.steps=3", f"rollout.spec.acceptance={acceptance}")
    trainer.train(until_step=2)
    cache = {row: [d["tokens"] for d in ds] for row, ds in trainer.source.inner.cache.items()}
    got = trainer.rollouts.collect_step(trainer.source, 2, 2, 99)
    reused = [s.reused_prefix for g in got.groups for s in g.samples]
    for g in got.groups:
        for j, s in enumerate(g.samples):
            draft = cache[g.prompt_id][j]
            assert s.reused_prefix <= len(draft) and s.tokens[: s.reused_prefix] == draft[: s.reused_prefix]
    assert got.sampling["spec_reused_tokens"] == sum(reused)
    assert (
        got.sampling["spec_verify_s"] > 0 and got.sampling["spec_rollout_s"] >= got.sampling["spec_verify_s"]
    )
    # ratio: the trained samples are scored for the cache; coupled drafts carry their stream instead
    assert (got.sampling.get("source_score_s", 0) > 0) == (acceptance == "ratio")
    assert "spec_saved_s" in got.sampling
    assert got.sampling["generated_tokens"] == sum(
        len(s.tokens) - s.reused_prefix for g in got.groups for s in g.samples
    )


def test_spec_saved_seconds_on_hand_made_counts():
    """The reused tokens at the step's seconds per drawn token (the rounds' time but the verification's),
    less the two teacher-forced passes; nothing drawn: no rate, no estimate."""
    from sparserl.rollout.layer import spec_metrics

    counts = {"spec_drafts": 4, "spec_draft_tokens": 100, "spec_accepted_tokens": 60, "spec_whole_drafts": 1,
              "spec_verify_s": 2.0}  # fmt: skip
    got = spec_metrics(counts, generated=40, rounds_s=6.0, score_s=1.0)
    assert got["spec_saved_s"] == pytest.approx(60 * (6.0 - 2.0) / 40 - 2.0 - 1.0)
    assert got["spec_accepted_frac"] == 0.6 and got["spec_whole_frac"] == 0.25
    assert "spec_saved_s" not in spec_metrics(counts, generated=0, rounds_s=6.0, score_s=1.0)  # no rate


def test_resume_is_exact_with_the_cache_in_the_checkpoint(tmp_path):
    extra = ("optim.lr=0.01", "trainer.steps=3", "trainer.save_every=1")
    straight = make(tmp_path, *extra, name="straight")
    straight.train()
    killed = make(tmp_path, *extra, name="killed")
    killed.train(until_step=2)
    cache = killed.source.state_dict()
    killed.close()
    resumed = make(tmp_path, *extra, name="killed", run_dir=tmp_path / "killed", resume=True)
    assert resumed.source.state_dict() == cache
    resumed.train()
    assert straight.source.state_dict() == resumed.source.state_dict()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any("sampling/spec_accepted_frac" in r for r in rows(tmp_path / "straight"))


def test_the_cache_is_bounded_oldest_prompt_first(tmp_path):
    trainer = make(tmp_path, "rollout.spec.max_cached_tokens=20", "trainer.steps=1")
    trainer.train()
    cache = trainer.source.inner.cache
    assert sum(len(d["tokens"]) for ds in cache.values() for d in ds) <= 20


def test_a_backend_that_cannot_score_says_so():
    with pytest.raises(
        NotImplementedError, match="cannot score completions teacher-forced, which rollout.spec"
    ):
        RolloutBackend().score([[1]], [[2]], 1.0)


def test_spec_refuses_what_needs_whole_samples():
    with pytest.raises(
        ConfigError, match="rollout.spec.enable=true starts samples from others .* trainer.log_acceptance"
    ):
        check_group_sources(load_config(None, ["rollout.spec.enable=true", "trainer.log_acceptance=true"]))
    with pytest.raises(ConfigError, match="rollout.spec.lenience=-1"):
        load_config(None, ["rollout.spec.lenience=-1"])
    with pytest.raises(ConfigError, match="rollout.spec.lenience=1.0 applies to acceptance=ratio only"):
        load_config(None, ["rollout.spec.enable=true", "rollout.spec.lenience=1"])
    with pytest.raises(ConfigError, match="rollout.spec.acceptance='maximal': choose one of coupled, ratio"):
        load_config(None, ["rollout.spec.enable=true", "rollout.spec.acceptance=maximal"])
    assert load_config(None, ["rollout.spec.enable=true", "rollout.spec.acceptance=ratio",
                              "rollout.spec.lenience=1"]).rollout.spec.lenience == 1.0  # fmt: skip


def test_a_plan_with_given_prefixes_samples_on_from_them(tmp_path):
    """A user source starting every sample from given tokens: they are kept whole, scored by the verifier,
    and the sample draws on from there on its own stream."""
    from sparserl.rollout import FreshPrompts, register_group_source
    from sparserl.rollout.sources import Draft

    @register_group_source("hinted")
    class Hinted(FreshPrompts):
        def plan(self, k, version):
            plans = super().plan(k, version)
            for p in plans:
                p.drafts = [Draft.prefix([5, 6, 7])] * p.n
            return plans

    trainer = Trainer(tiny_cfg(tmp_path, "sampling.method=hinted", "trainer.steps=1"), task=ParityTask())
    got = trainer.rollouts.collect_step(trainer.source, 2, 0, 3)
    for s in (s for g in got.groups for s in g.samples):
        assert s.tokens[:3] == [5, 6, 7] and s.reused_prefix == 3 and len(s.tokens) > 3
        assert all(math.isfinite(x) and x <= 0 for x in s.sampler_logps)
    assert "spec_accepted_frac" not in got.sampling and got.sampling["generated_tokens"] == sum(
        len(s.tokens) - 3 for g in got.groups for s in g.samples
    )
