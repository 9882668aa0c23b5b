"""The learner's update on a tiny model: bypass corrections, the Dr. GRPO divisor, NaN/inf safety."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer, rows, tiny_cfg, weights

from sparserl.algo import AlgoConfig, correction_reference
from sparserl.config import ConfigError, load_config
from sparserl.trainer import list_checkpoints
from sparserl.trainer.update import SingleProcess, WeightsDiverged, minibatch_updates, stand_in

TIGHT = ["kv.budget=10", "kv.interval=2", "kv.window=2", "rollout.max_new_tokens=16"]


def first_step(tmp_path: Path, *extra: str, name: str) -> dict:
    make_trainer(tiny_cfg(tmp_path, "trainer.steps=1", *extra, name=name)).train()
    return [r for r in rows(tmp_path / name) if "reward/mean" in r][0]


def test_correction_reference_is_the_learner_in_bypass_and_pi_old_otherwise() -> None:
    old, learner = torch.zeros(1, 2), torch.ones(1, 2, requires_grad=True)
    assert torch.equal(correction_reference(old, learner, AlgoConfig(correction_mode="decoupled")), old)
    ref = correction_reference(None, learner, AlgoConfig(correction_mode="bypass"))
    assert torch.equal(ref, learner.detach()) and not ref.requires_grad


def test_bypass_keeps_the_mismatch_visible_and_corrected(tmp_path: Path) -> None:
    """Bypass compares the learner (detached) with the sampler: a tight KV budget shows the same mismatch and
    triggers the same rejections as decoupled mode (one update per rollout, so learner = pi_old)."""
    rules = ["algo.preset=sparse-rl", "optim.mini_batch_size=0", *TIGHT]
    dec = first_step(tmp_path, *rules, name="decoupled")
    byp = first_step(tmp_path, *rules, "algo.correction_mode=bypass", name="bypass")
    assert dec["rollout_corr/kl"] > 0.01  # the setting really is mismatched
    assert byp["rollout_corr/kl"] == pytest.approx(dec["rollout_corr/kl"], rel=1e-3, abs=1e-5)
    assert byp["rollout_corr/token_keep_fraction"] == pytest.approx(dec["rollout_corr/token_keep_fraction"])
    assert byp["rollout_corr/token_keep_fraction"] < 1.0


def _captured_gradient(
    tmp_path: Path, grad_accum: int, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> list[torch.Tensor]:
    cfg = tiny_cfg(
        tmp_path,
        "algo.preset=dense",
        "algo.loss_agg_mode=seq-mean-token-sum-norm",
        "optim.mini_batch_size=0",
        "optim.grad_clip=0",
        "rollout.stop=a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q,r,s,t,u,v,w,x,y,z",  # completions of many lengths
        "rollout.max_new_tokens=24",  # so that micro-batches pad to different lengths
        f"optim.grad_accum={grad_accum}",
        "trainer.steps=1",
        *extra,
        name=f"accum{grad_accum}{len(extra)}",
    )
    trainer = make_trainer(cfg)
    grads: list[torch.Tensor] = []
    real = trainer.optimizer.step

    def spy(*a, **kw):
        grads.extend(p.grad.clone() for p in trainer.learner.params)
        return real(*a, **kw)

    monkeypatch.setattr(trainer.optimizer, "step", spy)
    trainer.train()
    return grads


def test_drgrpo_gradient_does_not_depend_on_grad_accum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """seq-mean-token-sum-norm divides by a constant (rollout.max_new_tokens), not by each micro-batch's
    padded length, so splitting the batch into 4 micro-batches gives the gradient of 1."""
    assert (
        load_config(None, ["algo.loss_agg_mode=seq-mean-token-sum-norm"]).algo.loss_token_norm == 64
    )  # max_new_tokens
    one = _captured_gradient(tmp_path, 1, monkeypatch)
    four = _captured_gradient(tmp_path, 4, monkeypatch)
    assert len(one) == len(four) > 0
    for a, b in zip(one, four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_nan_in_the_learner_pass_skips_the_update_under_the_default_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Default config (sparse-rl, pi_old from the learner's pass): a NaN log-prob skips that update, counts it,
    and the run goes on."""
    from sparserl.engine import scoring

    real = scoring.completion_logprobs
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            return (out[0] * float("nan"), *out[1:])
        return out

    monkeypatch.setattr("sparserl.engine.completion_logprobs", flaky)
    trainer = make_trainer(tiny_cfg(tmp_path, "optim.mini_batch_size=0", "trainer.steps=2"))
    assert trainer.reuses_learner_logprobs(8)
    trainer.train()
    logged = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["train/nonfinite_skipped_updates"] for r in logged] == [1.0, 0.0]
    assert all(torch.isfinite(v).all() for v in weights(trainer).values())


@pytest.mark.parametrize(
    "override", ["optim.lr=inf", "optim.lr=nan", "rollout.temperature=nan", "optim.eps=nan"]
)
def test_non_finite_settings_are_config_errors(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


def test_weights_that_turn_non_finite_stop_the_run_and_save_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=3", "optim.mini_batch_size=0"))
    trainer.train(until_step=1)
    real = trainer.optimizer.step

    def poisoned(*a, **kw):
        out = real(*a, **kw)
        trainer.learner.params[0].data.fill_(float("inf"))
        return out

    monkeypatch.setattr(trainer.optimizer, "step", poisoned)
    with pytest.raises(WeightsDiverged, match="optim.lr"):
        trainer.train()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-000001"]


def test_gradient_checkpointing_gives_the_same_gradient(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """optim.gradient_checkpointing recomputes the decoder's activations in the backward (transformers' own);
    the learner then runs each row's prompt itself instead of a group's shared pass, so the gradient equals the
    default's up to that rounding (the shared pass's tolerance, tests/test_scoring.py)."""
    from sparserl.engine.decoder import causal_lm

    trainer = make_trainer(tiny_cfg(tmp_path, "optim.gradient_checkpointing=true", name="gc"))
    assert causal_lm(trainer.policy.module).model.gradient_checkpointing
    trainer.close()
    plain = _captured_gradient(tmp_path, 2, monkeypatch)
    recomputed = _captured_gradient(tmp_path, 2, monkeypatch, "optim.gradient_checkpointing=true")
    assert len(plain) == len(recomputed) > 0
    for a, b in zip(plain, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_recomputed_mlps_give_the_same_gradient_and_keep_less(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """optim.recompute_modules=[mlp] reruns each layer's MLP in the backward (the group's prompt still shared):
    the gradient is the plain one bit for bit, the forward keeps fewer bytes for the backward, a deep copy (a
    sampler's replica) recomputes its own MLPs, and a name the layers lack is a ConfigError."""
    import copy

    from sparserl.engine.decoder import causal_lm
    from tests.saved_tensors import kept_bytes

    plain = _captured_gradient(tmp_path, 2, monkeypatch)
    recomputed = _captured_gradient(tmp_path, 2, monkeypatch, "optim.recompute_modules=[mlp]")
    assert len(plain) == len(recomputed) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))

    def kept(trainer) -> int:
        return kept_bytes(trainer.policy.module.train(), [[5, 6, 7]] * 4, [[8, 9, 10, 11, 12]] * 4)

    cfgs = [
        tiny_cfg(tmp_path, *extra, name=f"kept{len(extra)}")
        for extra in ((), ("optim.recompute_modules=[mlp]",))
    ]
    full, lean = (make_trainer(c) for c in cfgs)
    assert kept(lean) < kept(full)
    replica = copy.deepcopy(lean.policy.module)
    mlp = causal_lm(replica).model.layers[0].mlp
    assert mlp.forward.__self__ is mlp
    with pytest.raises(ConfigError, match=r"optim.recompute_modules names \['attention'\].*mlp"):
        load_config(None, ["optim.recompute_modules=[attention]"])
    with pytest.raises(ConfigError, match="gradient_checkpointing=true: whole layers"):
        load_config(None, ["optim.recompute_modules=[mlp]", "optim.gradient_checkpointing=true"])
    from sparserl.trainer.recompute import recompute_submodules

    with pytest.raises(ConfigError, match=r"optim.recompute_modules names 'mlp'.*\(Linear\) do not have"):
        recompute_submodules(torch.nn.ModuleList([torch.nn.Linear(2, 2)]), ["mlp"])
    full.close(), lean.close()


class _Lockstep(SingleProcess):
    """A collective whose ranks must all run every micro-batch's forward and backward (as FSDP's do)."""

    lockstep = True


def test_ranks_in_lockstep_backward_a_stand_in_for_a_non_finite_micro_batch_and_run_empty_ones() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    backwards: list[bool] = []

    def micro_step(micro: torch.Tensor, finite: bool):
        logp = weight * micro.float().sum()
        logp.register_hook(lambda g: backwards.append(bool(micro.numel())))
        if 1 in micro.tolist():  # this micro-batch is not finite
            return stand_in(logp * float("nan"))
        return logp.sum(), {"actor/loss": 0.0}, 1.0

    sums, taken, skipped = minibatch_updates(
        [torch.arange(4)], 2, optimizer, micro_step, lambda d, s: True, collective=_Lockstep()
    )
    assert (taken, skipped) == (0, 1) and len(backwards) == 2  # both micro-batches took a backward
    assert torch.equal(weight.detach(), torch.ones(3))  # and nothing stepped
    # a short mini-batch (a batch of variable size): its empty micro-batch still reaches the micro-step
    seen: list[int] = []
    minibatch_updates(
        [torch.tensor([0, 2, 3])], 4, optimizer, lambda m, f: (seen.append(len(m)), micro_step(m, f))[1],
        lambda d, s: True, collective=_Lockstep(),
    )  # fmt: skip
    assert seen == [1, 1, 1, 0]
