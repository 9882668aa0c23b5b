"""DistillSparse on tiny models: the block-sparse teacher-forced replay reproduces the sampler, the adapter is on
only on the sparse path, its update leaves the base bit-identical, resume is exact with it, bad input."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from sparserl.config import ConfigError
from sparserl.engine import KVConfig, RolloutEngine, score
from sparserl.engine.sparse_scoring import sparse_completion_logprobs
from sparserl.errors import UserError
from sparserl.models import tiny_model
from sparserl.trainer import Trainer
from tests.test_trainer import ParityTask, rows, tiny_cfg

# Measured on these tiny models (fp32, CPU, the three settings below): the replay's log-probs differ from the
# sampler's by at most 1.2e-5 (llama) and 6.7e-6 (qwen3), the dense scorer's by 0.18-2.1 (its worst token per
# setting). 5e-5 separates the two by more than three orders of magnitude.
REPLAY_TOL = 5e-5


@functools.cache
def tiny(arch: str):
    return tiny_model(arch, seed=0, num_layers=3)  # layers 0 and 1 dense by default, layer 2 block-sparse


def sampled(arch: str, kv: KVConfig, lengths=(30, 45, 17), n: int = 2, new: int = 60):
    model, tok = tiny(arch)
    engine = RolloutEngine(model, tok, kv=kv)
    engine.eos_ids = set()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 250, (k,), generator=g).tolist() for k in lengths]
    rollouts = engine.generate(prompts, n=n, max_new_tokens=new, seed=3)
    return model, [prompts[s.prompt_index] for s in rollouts.samples], rollouts.samples


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "kv",
    [
        KVConfig(method="block_topk", budget=48, page_size=8),
        KVConfig(method="block_topk", budget=32, page_size=8, dense_layers=[0]),
        KVConfig(method="block_topk", page_size=8, schedule=[[0, 24], [60, 40], [90, 64]]),
    ],
    ids=["budget48", "budget32-one-dense-layer", "schedule"],
)
def test_replay_reproduces_the_sampler(arch: str, kv: KVConfig) -> None:
    model, prompts, samples = sampled(arch, kv)
    completions = [s.completion_ids for s in samples]
    logp, mask = sparse_completion_logprobs(model, kv, prompts, completions)
    dense = score(model, prompts, completions)
    worst_replay = worst_dense = 0.0
    for i, s in enumerate(samples):
        assert int(mask[i].sum()) == len(s.logprobs)
        worst_replay = max(worst_replay, float((logp[i, : len(s.logprobs)] - s.logprobs).abs().max()))
        worst_dense = max(worst_dense, float((dense[i] - s.logprobs).abs().max()))
    assert worst_replay < REPLAY_TOL
    assert worst_dense > 100 * REPLAY_TOL  # the sparse reads matter: a dense replay could not pass


def test_replay_of_a_covering_budget_is_the_dense_score() -> None:
    kv = KVConfig(method="block_topk", budget=256, page_size=8)
    model, prompts, samples = sampled("llama", kv, new=20)
    completions = [s.completion_ids for s in samples]
    logp, _ = sparse_completion_logprobs(model, kv, prompts, completions)
    for i, d in enumerate(score(model, prompts, completions)):
        assert torch.allclose(logp[i, : len(d)], d, atol=REPLAY_TOL)


def test_replay_has_gradients_and_refuses_dense() -> None:
    kv = KVConfig(method="block_topk", budget=32, page_size=8)
    model, prompts, samples = sampled("llama", kv, new=20)
    logp, mask = sparse_completion_logprobs(model, kv, prompts[:2], [s.completion_ids for s in samples[:2]])
    (logp * mask).sum().backward()
    q = model.model.layers[2].self_attn.q_proj.weight  # a block-sparse layer's query: its selection path
    assert q.grad is not None and bool(q.grad.abs().sum() > 0)
    model.zero_grad(set_to_none=True)
    with pytest.raises(UserError, match="sparse kv.method"):
        sparse_completion_logprobs(model, KVConfig(), prompts, [[1, 2]] * len(prompts))


# --- the adapter in training ------------------------------------------------------------------------------------


def distill_cfg(tmp_path: Path, *extra: str, name: str = "run", lora: bool = True):
    """The trainer tests' tiny run, with block_topk rollouts, token TIS and a small distill adapter."""
    return tiny_cfg(
        tmp_path,
        f"model.lora={str(lora).lower()}",
        "model.device=cpu",  # compared with CPU-built models and samples: the CPU reference on any machine
        "rollout.max_new_tokens=24",
        "kv.method=block_topk",
        "kv.budget=48",
        "kv.page_size=8",
        "kv.dense_layers=0",
        "algo.preset=tis",
        "distill.enable=true",
        "distill.lora_r=4",
        "distill.probe_samples=4",
        "trainer.steps=3",
        "trainer.keep_last=3",
        "trainer.acceptance_bin=16",
        *extra,
        name=name,
    )


def addon(trainer: Trainer):
    """The run's DistillSparse add-on learner."""
    return next(a for a in trainer.addons if a.name == "distill")


def make(cfg, **kw) -> Trainer:
    return Trainer(cfg, task=ParityTask(), eval_task=ParityTask(), **kw)


@pytest.mark.parametrize("lora", [True, False], ids=["policy-lora", "full-policy"])
def test_adapter_is_on_only_on_the_sparse_path(tmp_path: Path, lora: bool) -> None:
    trainer = make(distill_cfg(tmp_path, lora=lora))
    torch.manual_seed(0)
    for p in trainer.policy.distill_parameters():  # a non-zero adapter (LoRA B starts at 0)
        p.data.normal_(0, 0.05)
    kv = trainer.cfg.kv
    model, prompts, samples = sampled("llama", kv, new=16)
    del model
    module = trainer.policy.module
    completions = [s.completion_ids for s in samples]
    with trainer.policy.sparse_path():
        rollouts = trainer.engine.generate(prompts[::2], n=2, max_new_tokens=16, seed=3)
    p2 = [prompts[::2][s.prompt_index] for s in rollouts.samples]
    c2 = [s.completion_ids for s in rollouts.samples]
    with trainer.policy.sparse_path():
        on, _ = sparse_completion_logprobs(module, kv, p2, c2)
    off, _ = sparse_completion_logprobs(module, kv, p2, c2)
    for i, s in enumerate(rollouts.samples):  # the sampler ran with the adapter: only the "on" replay matches
        assert float((on[i, : len(s.logprobs)] - s.logprobs).abs().max()) < REPLAY_TOL
        assert float((off[i, : len(s.logprobs)] - s.logprobs).abs().max()) > 100 * REPLAY_TOL
    # dense scoring and the reference run without it
    dense = score(module, prompts, completions)
    trainer.policy._activate([*trainer.policy.own_adapters, trainer.policy.distill_adapter])
    with_adapter = score(module, prompts, completions)
    trainer.policy._activate(trainer.policy.own_adapters)
    assert max(float((a - b).abs().max()) for a, b in zip(dense, with_adapter, strict=True)) > 1e-3
    # the policy's optimizer never holds the adapter, the adapter's never the policy
    policy_ids = {id(p) for p in trainer.learner.params}
    assert not policy_ids & {id(p) for p in addon(trainer).learner.params}
    trainer.close()


@pytest.mark.parametrize("lora", [True, False], ids=["policy-lora", "full-policy"])
def test_adapter_update_leaves_the_base_bit_identical(tmp_path: Path, lora: bool) -> None:
    trainer = make(distill_cfg(tmp_path, lora=lora))
    batch, _ = trainer.rollout(1)
    trainer.learner.update(1, batch)
    base = {k: v.detach().clone() for k, v in trainer.policy.module.state_dict().items()}
    adapter = [p.detach().clone() for p in addon(trainer).learner.params]
    out = addon(trainer).update(1, batch, trainer.scheduler.get_last_lr()[0])
    after = trainer.policy.module.state_dict()
    name = trainer.policy.distill_adapter
    for k, v in base.items():
        if f".{name}." not in k:
            assert torch.equal(v, after[k]), f"{k} changed in the adapter update"
    assert any(not torch.equal(a, p) for a, p in zip(adapter, addon(trainer).learner.params, strict=True))
    for key in ("distill/loss", "distill/tv", "distill/grad_norm", "distill/lr", "time/distill"):
        assert key in out, key
    assert any(k.startswith("distill/alpha_p5_before/bin") for k in out)
    assert any(k.startswith("distill/alpha_p5_after/bin") for k in out)
    assert all(p.requires_grad for p in trainer.learner.params)  # the policy is trainable again
    trainer.close()


@pytest.mark.parametrize("lora", [True, False], ids=["policy-lora", "full-policy"])
def test_resume_is_exact_with_the_adapter(tmp_path: Path, lora: bool) -> None:
    straight = make(distill_cfg(tmp_path, name="straight", lora=lora))
    straight.train()
    killed = make(distill_cfg(tmp_path, name="killed", lora=lora))
    killed.train(until_step=2)
    killed.close()
    resumed = make(distill_cfg(tmp_path, name="killed", lora=lora), run_dir=tmp_path / "killed", resume=True)
    assert resumed.state.step == 2
    resumed.train()
    name = straight.policy.distill_adapter
    a, b = straight.policy.adapter_weights(name), resumed.policy.adapter_weights(name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    wa, wb = straight.policy.weights(), resumed.policy.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    last = [r for r in rows(tmp_path / "straight") if r["step"] == 3 and "distill/loss" in r][0]
    again = [r for r in rows(tmp_path / "killed") if r["step"] == 3 and "distill/loss" in r][-1]
    assert last["distill/loss"] == again["distill/loss"]
    # the export is the dense policy alone: it loads as a plain model and scores like the policy, adapter off
    from sparserl.models import load_model

    exported, _ = load_model(str(tmp_path / "straight" / "final"))
    assert not any("lora_" in k for k in exported.state_dict())
    prompt, completion = [[5, 6, 7, 8]], [[9, 10, 11]]
    ours = score(straight.policy.module, prompt, completion)[0]
    assert torch.allclose(score(exported, prompt, completion)[0], ours, atol=1e-5)
    straight.close()
    resumed.close()


def test_resume_without_the_adapter_says_how_to_start_one(tmp_path: Path) -> None:
    plain = make(distill_cfg(tmp_path, "distill.enable=false", "trainer.steps=1"))
    plain.train()
    plain.close()
    with pytest.raises(ConfigError, match="distill.fresh_on_resume=true"):
        make(distill_cfg(tmp_path, "trainer.steps=2"), run_dir=tmp_path / "run", resume=True)
    fresh = make(
        distill_cfg(tmp_path, "trainer.steps=2", "distill.fresh_on_resume=true"),
        run_dir=tmp_path / "run",
        resume=True,
    )
    fresh.train()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())
    fresh.close()


@pytest.mark.parametrize(
    "extra, match",
    [
        (["algo.preset=dense", "kv.method=dense"], "rollouts are dense"),
        (["distill.adapter_name=default"], "policy's own LoRA adapter"),
        (["rollout.partial.enable=true"], "decoded in one go"),
        (["distill.lora_r=0"], "distill.lora_r"),
        (["distill.divergence=reverse_kl"], "distill.divergence='reverse_kl': choose one of tv, forward_kl"),
        (["distill.tail_weight=top"], "distill.tail_weight='top'"),
        (["distill.tail_fraction=0"], "distill.tail_fraction=0"),
        (["distill.lr_scale=5"], "DistillSparse v1's settings"),
    ],
)
def test_bad_distill_settings(tmp_path: Path, extra: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        distill_cfg(tmp_path, *extra)


def test_eval_loads_the_sparse_path_of_a_distill_run(tmp_path: Path) -> None:
    from sparserl.eval.loading import load_eval_model

    trainer = make(distill_cfg(tmp_path, "trainer.steps=1"))
    for p in trainer.policy.distill_parameters():
        p.data.normal_(0, 0.05)
    trainer.train()
    trainer.close()
    loaded = load_eval_model(str(tmp_path / "run"))
    assert loaded.kind == "run-checkpoint" and loaded.info["sparse_adapter"] == "distill"
    kv = trainer.cfg.kv
    _, prompts, _ = sampled("llama", kv, new=8)
    sparse = RolloutEngine(loaded.model, loaded.tokenizer, kv=kv)
    sparse.eos_ids = set()
    rollouts = sparse.generate(prompts[:2], n=1, max_new_tokens=16, seed=3)
    completions = [s.completion_ids for s in rollouts.samples]
    off, _ = sparse_completion_logprobs(loaded.model, kv, prompts[:2], completions)
    with trainer.policy.sparse_path():  # the run's own policy, adapter on: the sampler's numbers
        on, _ = sparse_completion_logprobs(trainer.policy.module, kv, prompts[:2], completions)
    for i, s in enumerate(rollouts.samples):
        assert float((on[i, : len(s.logprobs)] - s.logprobs).abs().max()) < REPLAY_TOL
        assert float((off[i, : len(s.logprobs)] - s.logprobs).abs().max()) > 100 * REPLAY_TOL


@pytest.mark.parametrize(
    "kv",
    [
        *(
            KVConfig(method=m, budget=24, interval=4, window=4)
            for m in ("rkv", "snapkv", "h2o", "streaming_llm", "random")
        ),
        KVConfig(method="rkv", budget=24, interval=4, window=4, granularity="shared"),
        KVConfig(method="snapkv", interval=4, window=4, schedule=[[0, 20], [60, 32]]),
    ],
    ids=["rkv", "snapkv", "h2o", "streaming_llm", "random", "rkv-shared", "snapkv-schedule"],
)
def test_eviction_replay_from_the_held_positions_reproduces_the_sampler(kv: KVConfig) -> None:
    """Measured (tiny llama, fp32): <= 9.3e-6 from the sampler for every method, 4.7-7.5 for dense scoring."""
    from sparserl.engine.held import HeldRecorder

    model, tok = tiny("llama")
    engine = RolloutEngine(model, tok, kv=kv)
    engine.eos_ids = set()
    recorder = HeldRecorder()
    engine.step_hooks.append(recorder)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(10, 250, (k,), generator=g).tolist() for k in (30, 45, 17)
    ]  # 30, 45: cut at once
    samples = engine.generate(prompts, n=2, max_new_tokens=40, seed=3).samples
    held = [recorder.records[i] for i in range(len(samples))]
    assert all(len(r.fed) > 1 for r in held)  # cut during decoding, not only at admission
    p, c = [prompts[s.prompt_index] for s in samples], [s.completion_ids for s in samples]
    logp, _ = sparse_completion_logprobs(model, kv, p, c, held=held)
    dense = score(model, p, c)
    for i, s in enumerate(samples):
        assert float((logp[i, : len(s.logprobs)] - s.logprobs).abs().max()) < REPLAY_TOL
        assert float((dense[i] - s.logprobs).abs().max()) > 100 * REPLAY_TOL
    with pytest.raises(UserError, match="HeldRecorder"):
        sparse_completion_logprobs(model, kv, p, c)


def test_distill_with_eviction_replays_what_each_rollout_held(tmp_path: Path) -> None:
    """R-KV rollouts: the layer records the held positions, the adapter's replay of the step's samples (adapter
    on) reproduces the sampler's log-probs, and the update and probe run."""
    cfg = distill_cfg(tmp_path, "kv.method=rkv", "kv.budget=24", "kv.interval=4", "kv.window=4")
    trainer = make(cfg)
    for p in trainer.policy.distill_parameters():
        p.data.normal_(0, 0.05)
    batch, _ = trainer.rollout(1)
    assert batch.held is not None and all(len(h.fed) > 1 for h in batch.held)
    with trainer.policy.sparse_path():
        logp, _ = sparse_completion_logprobs(
            trainer.policy.module, cfg.kv, batch.prompts, batch.completions, held=batch.held
        )
    gap = ((logp - batch.logp_sampler).abs() * batch.mask).max()
    assert float(gap) < REPLAY_TOL
    trainer.learner.update(1, batch)
    out = addon(trainer).update(1, batch, trainer.scheduler.get_last_lr()[0])
    assert "distill/loss" in out and any(k.startswith("distill/alpha_p5_after/") for k in out)
    trainer.close()


def test_distillation_pulls_the_sparse_path_toward_the_dense_policy_whatever_the_rewards(
    tmp_path: Path,
) -> None:
    """Ten adapter updates (distill.lr=1e-3) cut the mean TV = 1 - alpha between the sparse path and the dense
    policy on the batch by more than 15% (measured 0.0568 -> 0.0429, -24%, on the tiny llama; Adam's first step
    from the zero-initialised LoRA B overshoots: 0.0592 after one), and the update does not read the rewards: with
    the advantages replaced, the adapter moves bit for bit the same."""
    cfg = distill_cfg(tmp_path, "distill.lr=1e-3", "distill.probe_samples=0")
    trainer = make(cfg)
    batch, _ = trainer.rollout(1)
    learner = addon(trainer).learner
    start = [p.detach().clone() for p in learner.params]

    def tv() -> float:
        with torch.no_grad():
            teacher = learner._teacher(batch.prompts, batch.completions)
            student = learner._student(batch.prompts, batch.completions, None)
        m = batch.mask[:, : teacher.shape[1]]
        gap = 0.5 * (student.exp() - teacher.exp()).abs().sum(-1)
        return float((gap * m).sum() / m.sum())

    before = tv()
    for _ in range(10):
        learner.update(batch, 0.0)
    assert tv() < 0.85 * before, (before, tv())
    moved = [p.detach().clone() for p in learner.params]
    for p, s0 in zip(learner.params, start, strict=True):
        p.data.copy_(s0)
    learner.optimizer.state.clear()
    batch.advantages.normal_()
    for _ in range(10):
        learner.update(batch, 0.0)
    assert all(torch.equal(a, p) for a, p in zip(moved, learner.params, strict=True))
    trainer.close()


def test_configs_saved_before_v2_load_with_distill_off(tmp_path: Path) -> None:
    """Run directories saved before DistillSparse v2 carry distill.lr_scale and distill.kl_coef: dropped when
    distill was off (every such run resumes), refused when it was on (v2 cannot continue v1's adapter)."""
    from sparserl.config import load_config

    old = tmp_path / "config.yaml"
    old.write_text("distill:\n  enable: false\n  lr_scale: 5.0\n  kl_coef: 0.001\n")
    assert load_config(old).distill.lr == 5e-5
    old.write_text("distill:\n  enable: true\n  lr_scale: 5.0\n  kl_coef: 0.001\n")
    with pytest.raises(ConfigError, match="distill.lr_scale, distill.kl_coef: DistillSparse v1's settings"):
        load_config(old)
