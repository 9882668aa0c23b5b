"""The training loop on a tiny model: a short run, exact resume, NaN-loss skipping, checkpoint atomicity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparserl.config import load_config
from sparserl.seeds import PromptSampler
from sparserl.tasks import Example, Task
from sparserl.trainer import Trainer, latest_checkpoint, list_checkpoints, save_checkpoint
from sparserl.trainer.checkpoint import TrainerState, load_checkpoint


class ParityTask(Task):
    """A task whose reward varies on a random tiny model (parity of the completion's character codes), so
    advantages are non-zero and every step really changes the weights."""

    name = "parity"

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> Example:
        return Example(messages=[{"role": "user", "content": f"Say something about {i}."}], answer=str(i % 2))

    def reward(self, completion_text: str, example: Example) -> float:
        return float(sum(map(ord, completion_text)) % 2)


def tiny_cfg(tmp_path: Path, *extra: str, name: str = "run"):
    return load_config(
        None,
        [
            "model.spec=tiny-llama",
            "model.lora=false",
            "rollout.prompts_per_step=2",
            "rollout.n=4",
            "rollout.max_new_tokens=12",
            "kv.budget=20",
            "kv.interval=4",
            "optim.lr=1e-3",
            "optim.mini_batch_size=4",
            "optim.grad_accum=2",
            "trainer.steps=4",
            "trainer.eval_prompts=0",
            "trainer.keep_last=2",
            "logging.progress=false",
            f"trainer.output_dir={tmp_path}",
            f"trainer.run_name={name}",
            *extra,
        ],
    )


def make_trainer(cfg, **kw) -> Trainer:
    return Trainer(cfg, task=ParityTask(), eval_task=ParityTask(), **kw)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.weights().items()}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_three_step_run(tmp_path: Path) -> None:
    cfg = tiny_cfg(tmp_path, "trainer.steps=3", "trainer.eval_prompts=2")
    trainer = make_trainer(cfg)
    before = weights(trainer)
    summary = trainer.train()
    run = tmp_path / "run"
    steps = [r["step"] for r in rows(run) if "reward/mean" in r]
    assert steps == [1, 2, 3]
    last = [r for r in rows(run) if r["step"] == 3 and "reward/mean" in r][0]
    for key in (
        "reward/mean",
        "length/mean",
        "rejection_rate",
        "rollout_corr/kl",
        "actor/loss",
        "kv/saved_fraction",
    ):
        assert key in last, key
    assert last["kv/saved_fraction"] > 0  # rollouts really were sparse
    assert [p.name for p in list_checkpoints(run)] == ["step-000002", "step-000003"]  # keep_last=2
    assert any((run / "tb").iterdir())
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    assert (run / "final" / "config.json").is_file()
    assert summary["steps"] == 3 and summary["eval_reward_before"] is not None
    assert summary["eval_reward_after"] is not None and summary["kv_saved_fraction"] > 0
    after = weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before), "training did not change the weights"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_equivalence(tmp_path: Path, lora: bool) -> None:
    extra = ["model.lora=true", "model.lora_r=4", "optim.lr=1e-2"] if lora else []
    extra += ["optim.schedule=cosine", "optim.warmup_steps=1", "optim.ppo_epochs=2"]
    straight = make_trainer(tiny_cfg(tmp_path, *extra, name="straight"))
    straight.train()

    first = make_trainer(tiny_cfg(tmp_path, *extra, name="killed"))
    first.train(until_step=2)  # as if killed right after step 2's checkpoint
    del first
    resumed = make_trainer(
        tiny_cfg(tmp_path, *extra, name="killed"), run_dir=tmp_path / "killed", resume=True
    )
    assert resumed.state.step == 2
    resumed.train()

    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    ra = {r["step"]: r for r in rows(tmp_path / "straight") if "reward/mean" in r}
    rb = {r["step"]: r for r in rows(tmp_path / "killed") if "reward/mean" in r}
    assert sorted(rb) == [1, 2, 3, 4]  # no duplicated or missing steps in the log
    for step in (3, 4):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/lr", "rollout_corr/kl"):
            assert ra[step][key] == rb[step][key], (step, key)


def test_resume_drops_steps_logged_after_the_checkpoint(tmp_path: Path) -> None:
    cfg = tiny_cfg(tmp_path, "trainer.save_every=2", "trainer.steps=3")
    make_trainer(cfg).train(until_step=3)  # steps 1-3 logged, checkpoint at 2 only (3 is the last: saved too)
    run = tmp_path / "run"
    # simulate a kill after step 3 was logged but before its checkpoint
    for p in list_checkpoints(run):
        if p.name == "step-000003":
            import shutil

            shutil.rmtree(p)
    resumed = make_trainer(
        tiny_cfg(tmp_path, "trainer.save_every=2", "trainer.steps=3"), run_dir=run, resume=True
    )
    assert resumed.state.step == 2
    resumed.train()
    assert [r["step"] for r in rows(run) if "reward/mean" in r] == [1, 2, 3]


def test_nan_loss_is_skipped_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sparserl.trainer.update as loop

    real = loop.policy_loss
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:  # the first micro-batch of the first mini-batch
            loss = loss * float("nan")
        return loss, metrics

    monkeypatch.setattr(loop, "policy_loss", flaky)
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=2"))
    before = weights(trainer)
    trainer.train()
    run_rows = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert run_rows[0]["train/nonfinite_skipped_updates"] == 1.0
    assert run_rows[-1]["train/nonfinite_skips"] == 1.0  # cumulative counter
    assert trainer.state.step == 2  # the run went on
    after = weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # later mini-batches still trained
    assert all(torch.isfinite(v).all() for v in after.values())


def _tiny_optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return p, opt, sched


def test_checkpoint_keep_last_and_leftover_temp_dir(tmp_path: Path) -> None:
    p, opt, sched = _tiny_optimizer()
    for step in range(1, 5):
        save_checkpoint(tmp_path, TrainerState(step=step), {"w": p.data * step}, opt, sched, keep_last=2)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    # a kill mid-write leaves a temp dir (even one that looks complete): it is never picked up
    leftover = tmp_path / "checkpoints" / ".tmp-step-000005-abc"
    leftover.mkdir()
    (leftover / "trainer_state.json").write_text(json.dumps({"step": 5}))
    assert latest_checkpoint(tmp_path).name == "step-000004"
    ck = load_checkpoint(latest_checkpoint(tmp_path))
    assert ck.state.step == 4 and torch.equal(ck.weights["w"], torch.full((3,), 4.0))
    save_checkpoint(tmp_path, TrainerState(step=5), {"w": p.data}, opt, sched, keep_last=2)
    assert not leftover.exists()  # cleaned by the next save
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-000004", "step-000005"]


def test_checkpoint_write_killed_midway_keeps_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, opt, sched = _tiny_optimizer()
    save_checkpoint(tmp_path, TrainerState(step=1), {"w": p.data}, opt, sched, keep_last=1)
    import sparserl.trainer.checkpoint as ck

    real_save = torch.save

    def dying_save(obj, path, *a, **k):
        if str(getattr(path, "name", path)).endswith("scheduler.pt"):
            raise KeyboardInterrupt  # the process dies in the middle of writing step 2
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ck.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, TrainerState(step=2), {"w": p.data * 2}, opt, sched, keep_last=1)
    monkeypatch.setattr(ck.torch, "save", real_save)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step-000001"]
    assert load_checkpoint(latest_checkpoint(tmp_path)).state.step == 1


def test_fresh_run_refuses_a_dir_with_checkpoints(tmp_path: Path) -> None:
    make_trainer(tiny_cfg(tmp_path, "trainer.steps=1")).train()
    with pytest.raises(FileExistsError, match="--resume"):
        make_trainer(tiny_cfg(tmp_path, "trainer.steps=1"))


def test_resume_without_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        make_trainer(tiny_cfg(tmp_path), run_dir=tmp_path / "nothing", resume=True)


def test_lora_reference_is_the_adapter_free_model(tmp_path: Path) -> None:
    from sparserl.engine import score

    trainer = make_trainer(
        tiny_cfg(tmp_path, "model.lora=true", "model.lora_r=4", "optim.lr=5e-2", "trainer.steps=2")
    )
    assert trainer.policy._ref is None  # no second copy of the model
    prompt, completion = [[3, 40, 41, 42]], [[50, 51, 52]]
    base = score(trainer.policy.module, prompt, completion)[0]
    trainer.train()
    with trainer.policy.reference() as ref:
        ref_lp = score(ref, prompt, completion)[0]
    trained = score(trainer.policy.module, prompt, completion)[0]
    assert torch.allclose(ref_lp, base, atol=1e-6)  # adapters off = the initial model
    assert not torch.allclose(trained, base, atol=1e-6)  # adapters on = the trained policy
    assert all("lora" in k for k in trainer.policy.weights())  # checkpoints hold only the adapter


def test_rollouts_run_on_the_backends_own_engine_and_the_trainer_builds_none_unasked(tmp_path: Path) -> None:
    """The local backend builds its engine over the policy's modules from the config; the trainer's own engine
    (held-out evaluation, the judges) is built only when asked for, with the same settings."""
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=1"))
    trainer.train()
    engine = trainer.rollouts.backend.engine
    assert engine.model is trainer.policy.module and trainer.own_engine.engine is None
    assert trainer.engine.kv == engine.kv and trainer.engine.decoder.dtype == engine.decoder.dtype
    trainer.close()


def test_dense_preset_uses_a_dense_cache(tmp_path: Path) -> None:
    trainer = make_trainer(tiny_cfg(tmp_path, "algo.preset=dense", "trainer.steps=1"))
    assert trainer.rollouts.backend.engine.evictor is None
    trainer.train()
    row = [r for r in rows(tmp_path / "run") if "reward/mean" in r][0]
    assert row["kv/saved_fraction"] == 0.0


def test_prompt_sampler_is_a_resumable_stream() -> None:
    a = PromptSampler(7, seed=3)
    stream = a.take(20)
    assert sorted(stream[:7]) == list(range(7))  # each epoch is a permutation
    b = PromptSampler(7, seed=3, position=9)
    assert b.take(11) == stream[9:]


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_missing_tracker_fails_fast(tmp_path: Path, backend: str) -> None:
    import importlib.util

    from sparserl.config import ConfigError

    if importlib.util.find_spec(backend) is not None:
        pytest.skip(f"{backend} is installed here")
    with pytest.raises(ConfigError, match=f"logging.{backend}=true but {backend} is not installed"):
        make_trainer(tiny_cfg(tmp_path, f"logging.{backend}=true"))
    assert not (tmp_path / "run").exists()  # failed before creating anything


def test_bad_lora_targets_name_the_key(tmp_path: Path) -> None:
    from sparserl.config import ConfigError

    with pytest.raises(ConfigError, match="model.lora_targets"):
        make_trainer(tiny_cfg(tmp_path, "model.lora=true", "model.lora_targets=no_such_proj"))


def test_pi_old_from_the_learner_pass_equals_a_separate_scoring_pass(tmp_path: Path) -> None:
    """One update per rollout: pi_old taken from the learner's own forward gives the update a separate
    dense scoring pass gives (same weights, same corrections), with one forward pass less."""
    base = [
        "optim.mini_batch_size=0",
        "trainer.steps=1",
        "model.lora=true",
        "model.lora_r=4",
        "optim.lr=1e-2",
    ]
    reused = make_trainer(tiny_cfg(tmp_path, *base, name="reuse"))
    scored = make_trainer(tiny_cfg(tmp_path, *base, "trainer.reuse_learner_logprobs=false", name="score"))
    assert reused.reuses_learner_logprobs(8) and not scored.reuses_learner_logprobs(8)
    reused.train()
    scored.train()
    a, b = weights(reused), weights(scored)
    assert any(
        not torch.equal(a[k], weights(make_trainer(tiny_cfg(tmp_path, *base, name="init")))[k]) for k in a
    )
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    ra = [r for r in rows(tmp_path / "reuse") if "reward/mean" in r][0]
    rb = [r for r in rows(tmp_path / "score") if "reward/mean" in r][0]
    assert ra["rejection_rate"] == rb["rejection_rate"]
    assert abs(ra["rollout_corr/kl"] - rb["rollout_corr/kl"]) < 1e-5


def test_several_updates_per_rollout_score_pi_old_separately(tmp_path: Path) -> None:
    assert not make_trainer(
        tiny_cfg(tmp_path, "optim.ppo_epochs=2", "optim.mini_batch_size=0")
    ).reuses_learner_logprobs(8)
    assert not make_trainer(tiny_cfg(tmp_path, name="r2")).reuses_learner_logprobs(8)  # two mini-batches


@pytest.mark.slow
def test_embedded_default_one_step_on_smollm2(tmp_path: Path) -> None:
    """The real default (SmolLM2-135M GGUF, LoRA, arithmetic, sparse-rl + R-KV), shrunk to one small step."""
    cfg = load_config(
        None,
        [
            "rollout.prompts_per_step=1",
            "trainer.steps=1",
            "trainer.eval_prompts=2",
            "logging.progress=false",
            f"trainer.output_dir={tmp_path}",
            "trainer.run_name=smol",
        ],
    )
    summary = Trainer(cfg).train()
    row = [r for r in rows(tmp_path / "smol") if "reward/mean" in r][0]
    assert summary["steps"] == 1 and row["kv/positions_saved_fraction"] > 0  # rollouts really were evicted
    assert summary["kv_saved_fraction"] is not None  # vs the dense engine's own allocation: it may be 0
    assert (tmp_path / "smol" / "final" / "config.json").is_file()
    assert (tmp_path / "smol" / "checkpoints" / "step-000001" / "adapter.safetensors").is_file()


def test_a_prompts_samples_do_not_depend_on_the_other_prompts_of_its_batch(tmp_path):
    """Sample j of task row i is keyed by (row, j): the same step draws the same tokens for it whichever prompt
    shares its batch, and in whichever order."""
    got = {}
    for name, rows in (("ab", [3, 7]), ("ba", [7, 3]), ("ac", [3, 11])):
        trainer = make_trainer(tiny_cfg(tmp_path, "rollout.max_new_tokens=8", name=name))
        trainer.source.inner.choose = lambda k, version, rows=rows: rows
        trainer.train_rows = list(range(50))
        batch, _ = trainer.rollout(1)
        got[name] = {(row, j): batch.completions[p * 4 + j] for p, row in enumerate(rows) for j in range(4)}
    assert got["ab"] == got["ba"]
    assert {k: v for k, v in got["ac"].items() if k[0] == 3} == {
        k: v for k, v in got["ab"].items() if k[0] == 3
    }
    assert got["ab"][3, 0] != got["ab"][3, 1] or got["ab"][3, 1] != got["ab"][3, 2]  # samples still differ


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu0", "model.device 'gpu0' is not a torch device"), ("cuda", "model.device cuda: no cuda device")],
)
def test_a_bad_or_absent_device_names_the_config_key(tmp_path: Path, device: str, message: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    from sparserl.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_trainer(tiny_cfg(tmp_path, f"model.device={device}"))
