"""Overlapped steps (rollout.overlap): step t+1's rollout is drawn by policy t-1 on a thread while step t
updates. Off (or max_staleness=0) it is the run without it; on, every batch says which version drew it, the
corrections see the stale sampler, and a resume (after a stop, or kill -9 anywhere) equals the uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from sparserl.engine import score
from sparserl.trainer.checkpoint import latest_checkpoint
from sparserl.trainer.overlap import Ahead, StepRollouts
from tests.test_sigterm import TINY, final_weights, train_cmd
from tests.test_trainer import make_trainer, rows, tiny_cfg, weights

OVERLAP = ["rollout.overlap.enable=true", "trainer.steps=4", "trainer.eval_prompts=0"]
TIMINGS = ("time", "tokens_per_s", "_s", "rss", "seconds")  # wall clocks and process memory vary


def _same_rows(a: Path, b: Path) -> None:
    """Every metric of every step equal, timings apart."""
    ra, rb = rows(a), rows(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb, strict=True):
        keys = {k for k in x if not any(t in k for t in TIMINGS)}
        assert keys == {k for k in y if not any(t in k for t in TIMINGS)}
        for k in keys:
            assert x[k] == y[k] or (x[k] != x[k] and y[k] != y[k]), (x["step"], k, x[k], y[k])


def _same_weights(a, b) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_overlap_with_max_staleness_zero_is_the_run_without(tmp_path: Path) -> None:
    off = make_trainer(tiny_cfg(tmp_path, "trainer.steps=3", "trainer.eval_prompts=0", name="off"))
    off.train()
    on = make_trainer(tiny_cfg(tmp_path, *OVERLAP[:1], "rollout.overlap.max_staleness=0", "trainer.steps=3",
                               "trainer.eval_prompts=0", name="zero"))  # fmt: skip
    on.train()
    _same_weights(off, on)
    _same_rows(tmp_path / "off", tmp_path / "zero")
    off.close(), on.close()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_every_batch_after_the_first_is_drawn_one_version_behind(tmp_path: Path, lora: bool) -> None:
    extra = ["model.lora=true", "model.lora_r=4", "optim.lr=1e-2"] if lora else []
    # a dense sampler, so that its recorded log-probs can be checked against policy 0's teacher-forced ones
    trainer = make_trainer(tiny_cfg(tmp_path, *OVERLAP, *extra, "algo.sparse_rollout=false"))
    seen = []
    learn = trainer.learn

    def spy(step, batch):
        drawn = set(batch.versions[batch.mask].tolist())
        seen.append((step, drawn, batch.logp_sampler.clone(), batch.prompts, batch.completions))
        return learn(step, batch)

    trainer.learn = spy
    before = {k: v.clone() for k, v in trainer.policy.weights().items()}
    trainer.train()
    assert [(s, d) for s, d, *_ in seen] == [(1, {0}), (2, {0}), (3, {1}), (4, {2})]
    by_step = {r["step"]: r for r in rows(trainer.run_dir) if "reward/mean" in r}
    assert by_step[1]["rollout/staleness_max"] == 0 and by_step[1]["rollout/off_policy_token_frac"] == 0
    for step in (2, 3, 4):
        assert by_step[step]["rollout/staleness_mean"] == 1 == by_step[step]["rollout/staleness_max"]
        assert by_step[step]["rollout/off_policy_token_frac"] == 1
    # step 2's sampler log-probs are policy 0's (the initial weights), not the learner's at step 2
    _, _, logp, prompts, completions = seen[1]
    trainer.policy.load_weights(before)
    with torch.no_grad():
        again = score(trainer.policy.module, prompts, completions, temperature=1.0)
    for i, row in enumerate(again):
        torch.testing.assert_close(logp[i, : len(row)], row.float(), atol=1e-4, rtol=0)
    assert by_step[2]["rollout_corr/kl"] != 0  # the corrections see the mismatch policy 1 vs policy 0
    trainer.close()


def test_the_samplers_packed_copy_is_freed_once_its_rollout_is_drawn(tmp_path: Path) -> None:
    """Overlapped, neither the replica's packed weights nor the learner's (the held-out evaluation's) sit through
    the update (513 MiB each on SmolLM2)."""
    from sparserl.engine import weights as packing

    trainer = make_trainer(tiny_cfg(tmp_path, *OVERLAP, "trainer.eval_prompts=2"))
    checked, learn = [], trainer.learn
    modules = [trainer.steps.replica, trainer.policy.module]

    def spy(step, batch):
        ahead = trainer.steps.ahead
        if ahead is not None:
            ahead.future.result()  # the next rollout drawn, while this step would update
            checked.append([packing.holds_packed(m) for m in modules])
        return learn(step, batch)

    trainer.learn = spy
    trainer.train()
    assert checked == [[False, False]] * 3
    trainer.close()


def test_a_batch_too_stale_is_drawn_again_never_trained() -> None:
    drawn = []

    def draw(step, version):
        drawn.append((step, version))
        return f"batch {step} by {version}"

    module = torch.nn.Linear(2, 2)
    steps = StepRollouts(draw, lambda v, s: None, module, torch.nn.Linear(2, 2), last_step=1)
    done: Future = Future()
    done.set_result("stale batch")
    steps.held = 3
    steps.ahead = Ahead(step=5, drawn_by=2, future=done, started_from={})  # learner at 4: two behind
    assert steps.take(5, dict) == "batch 5 by 3" and drawn == [(5, 3)]
    steps.close()


def test_stopped_then_resumed_equals_uninterrupted(tmp_path: Path) -> None:
    straight = make_trainer(tiny_cfg(tmp_path, *OVERLAP, name="straight"))
    straight.train()
    first = make_trainer(tiny_cfg(tmp_path, *OVERLAP, name="cut"))
    first.train(until_step=2)  # step 3's rollout is in flight when the run stops
    first.close()
    resumed = make_trainer(tiny_cfg(tmp_path, *OVERLAP, name="cut"), run_dir=tmp_path / "cut", resume=True)
    resumed.train()
    _same_weights(straight, resumed)
    _same_rows(tmp_path / "straight", tmp_path / "cut")
    straight.close(), resumed.close()


@pytest.mark.parametrize("at", ["rollout", "update"])
def test_kill_9_anywhere_then_resume_equals_uninterrupted(tmp_path: Path, at: str) -> None:
    """SIGKILL once step 2's checkpoint exists: during step 3's update (the rollout of step 4 drawn beside it)
    or later in the step's rollout; the resumed run exports the very weights of the uninterrupted one."""
    common = [*TINY, "rollout.overlap.enable=true", "trainer.steps=4", f"trainer.output_dir={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = subprocess.run(train_cmd(*common, "trainer.run_name=whole"), capture_output=True, text=True, env=env,
                           timeout=300)  # fmt: skip
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = tmp_path / "cut"
    proc = subprocess.Popen(train_cmd(*common, "trainer.run_name=cut"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    try:
        deadline = time.time() + 240
        while (ckpt := latest_checkpoint(run) if run.is_dir() else None) is None or ckpt.name < "step-000002":
            assert proc.poll() is None and time.time() < deadline, "the run ended before step 2's checkpoint"
            time.sleep(0.01)
        time.sleep(0.0 if at == "update" else 0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    resumed = subprocess.run(
        train_cmd("--resume", str(run)), capture_output=True, text=True, env=env, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = final_weights(tmp_path / "whole"), final_weights(run)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


@pytest.mark.parametrize(
    "keys",
    [
        ["rollout.partial.enable=true"],
        ["rollout.kv_memory_cap=64KiB"],
        ["distill.enable=true"],
        ["sampling.method=dars"],
        ["sampling.dynamic=true", "algo.preset=dapo"],
        ["kv.method=block_topk", "kv.budget=16", "kv.page_size=4"],
        ["rollout.tree.enable=true", "rollout.n=2", "rollout.tree.forks=1"],
    ],
    ids=["april", "kv-cap", "distill", "dars", "dynamic", "block-topk", "tree"],
)
def test_overlap_runs_with_the_rollout_systems(tmp_path: Path, keys: list[str]) -> None:
    """Each system beside overlap: three steps, the later batches drawn one version behind, finite updates."""
    trainer = make_trainer(
        tiny_cfg(tmp_path, *OVERLAP[:1], "trainer.steps=3", "trainer.eval_prompts=0", *keys)
    )
    trainer.train()
    by_step = {r["step"]: r for r in rows(trainer.run_dir) if "reward/mean" in r}
    assert sorted(by_step) == [1, 2, 3]
    assert by_step[3]["rollout/staleness_max"] >= 1
    assert all(torch.isfinite(w).all() for w in trainer.policy.weights().values())
    trainer.close()


@pytest.mark.slow  # starts Ray and a rollout worker (~20 s)
def test_overlap_with_a_ray_rollout_worker_equals_the_local_overlapped_run(tmp_path: Path) -> None:
    """The rollout drawn ahead by a Ray worker (weights pushed once per version): the same weights and metrics
    as the local backend's overlapped run, every batch after the first one version behind."""
    local = make_trainer(
        tiny_cfg(tmp_path, *OVERLAP[:1], "trainer.steps=3", "trainer.eval_prompts=0", name="local")
    )
    local.train()
    ray = make_trainer(tiny_cfg(tmp_path, *OVERLAP[:1], "trainer.steps=3", "trainer.eval_prompts=0",
                                "distributed.rollout_workers=1", name="ray"))  # fmt: skip
    try:
        ray.train()
        _same_weights(local, ray)
        by_step = {r["step"]: r for r in rows(ray.run_dir) if "reward/mean" in r}
        assert [by_step[s]["rollout/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
        for step, row in ((r["step"], r) for r in rows(local.run_dir) if "reward/mean" in r):
            for key in ("reward/mean", "actor/loss", "rollout_corr/kl"):
                assert row[key] == by_step[step][key], (step, key)
    finally:
        local.close()
        ray.close()


@pytest.mark.parametrize("lora", ["false", "true"])
def test_a_rollout_drawn_ahead_brings_its_reference_logprobs(tmp_path: Path, lora: str) -> None:
    """The sampler's thread scores the reference beside a rollout it drew ahead (adapters off on its replica,
    or the frozen copy), bit for bit what the learner's thread would compute, so the step does not wait for it."""
    trainer = make_trainer(tiny_cfg(tmp_path, *OVERLAP, f"model.lora={lora}"))
    batch, _ = trainer.rollout(1)  # drawn here: its reference scored by the learner's thread
    for step in (2, 3):  # step 3's is drawn by policy 1, whose adapters are no longer zero
        trainer.learn(step - 1, batch)
        ahead = trainer.steps.ahead.future.result()
        assert ahead.ref_logps is not None and trainer.cfg.algo.kl_coef > 0
        batch, _ = trainer.rollout(step)
        with trainer.policy.reference() as ref:
            direct = trainer._score(ref, batch.prompts, batch.completions, batch.mask.shape[1])
        assert batch.logp_ref is ahead.ref_logps and torch.equal(batch.logp_ref, direct)
    trainer.close()
