"""Data-parallel learners (`distributed.learners`) on a local 2-CPU Ray: 2 learners give 1 learner's update on the
same batch, a micro-batch that is not finite on one rank makes every rank skip, a checkpoint written with 2
learners resumes with 1 and one written with 1 resumes with 2, rollout workers sample with rank 0's weights, and
learners that cannot all start are named within seconds."""

from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray")

from sparserl.config import ConfigError, load_config  # noqa: E402
from sparserl.seeds import SHUFFLE, derive_seed  # noqa: E402
from tests.ray_cluster import local_ray, ray_cpus_free  # noqa: E402, F401 - the module's local Ray
from tests.test_ray_backend import two_steps  # noqa: E402
from tests.test_trainer import make_trainer, rows, tiny_cfg, weights  # noqa: E402

# Measured: the largest |difference| of any weight between 1 and 2 learners. With optim.grad_accum=4 a rank sums
# its 2 micro-batches' gradients before the all-reduce adds the ranks', an order of float additions that one
# learner does not take, and AdamW divides each gradient by its own RMS, so where a gradient nearly cancels the
# rounding moves a weight by a small fraction of the lr. Here (lr 1e-3, 2 epochs): 1.2e-7 after step 1, 2.2e-7
# after step 2; over seeds 1-2 and 3 steps at most 9.5e-7 (full weights, lr 1e-3) and 4.3e-6 (LoRA r=4,
# lr 1e-2). With grad_accum=2 (one micro-batch a rank) the additions are the same and the weights equal bit for
# bit (3 steps, both seeds; and the resume test below).
TOLERANCE = 2e-6
# FSDP (distributed.fsdp): each row runs its whole sequence (no shared prompt pass) and the gradients are
# reduce-scattered per backward, other float orders again. Measured: 2.7e-7 after 2 steps (the test below), 5.0e-6
# after 2 sharded + 2 one-learner steps (the resume test, cosine schedule); FSDP_TOLERANCE is 4x the latter.
FSDP_TOLERANCE = 2e-5


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("held", ["copies", "fsdp", "fsdp-lora", "fsdp-recompute"])
def test_two_learners_give_one_learners_update_and_skip_together(tmp_path, held):
    """Bypass mode: the correction metrics compare the learner's own log-probs, which each rank has for its rows
    only (merged before the metrics). Step 2's batch has a NaN in a row that rank 1 runs. With FSDP each rank
    holds half the weights and AdamW state; it runs each row's whole sequence (no shared prompt pass)."""
    extra = (
        "algo.preset=sparse-rl",
        "algo.correction_mode=bypass",
        "optim.grad_accum=4",
        "optim.ppo_epochs=2",
    )
    sharded = ("distributed.fsdp=true",) if held.startswith("fsdp") else ()
    if held == "fsdp-lora":  # the frozen base is sharded too; only the adapter trains (measured 1.9e-6 here)
        extra = (*extra, "model.lora=true", "optim.lr=1e-2")
    if held == "fsdp-recompute":  # each sharded layer's MLP recomputed inside its backward
        extra = (*extra, "optim.recompute_modules=[mlp]")
    one = make_trainer(tiny_cfg(tmp_path, *extra, name="one"))
    two = make_trainer(tiny_cfg(tmp_path, *extra, "distributed.learners=2", *sharded, name="two"))
    try:
        assert weights(one).keys() == weights(two).keys() and max_abs_diff(weights(one), weights(two)) == 0
        batch, _ = one.rollout(1)
        a, b = one.learn(1, batch), two.learn(1, batch)
        holds = ray.get([rank.parameter_bytes.remote() for rank in two.learner.ranks])
        whole = sum(p.numel() * p.element_size() for p in one.learner.params)
        if held == "copies":
            assert holds == [whole, whole]
        else:  # each rank holds half of every weight (a row more where a dimension is odd)
            assert sum(holds) == whole and max(holds) <= whole / 2 * 1.05, (holds, whole)
        print(f"step 1: max |1 learner - 2 learners| = {max_abs_diff(weights(one), weights(two)):.3g}")
        assert max_abs_diff(weights(one), weights(two)) <= (TOLERANCE if held == "copies" else FSDP_TOLERANCE)
        for key in ("actor/loss", "actor/grad_norm", "rollout_corr/kl", "rollout_corr/token_keep_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert a["actor/lr"] == b["actor/lr"] == two.scheduler.get_last_lr()[0]
        # the completions table's per-sample columns come from rank 0, as one learner's
        s1, s2 = one.learner.sample_stats, two.learner.sample_stats
        assert s2 is not None and s2.rejected == s1.rejected
        assert [g is None for g in s2.logp_gap] == [g is None for g in s1.logp_gap]
        assert [g for g in s2.logp_gap if g is not None] == pytest.approx(
            [g for g in s1.logp_gap if g is not None], abs=1e-6
        )

        one.state.step = two.state.step = 1
        batch, _ = one.rollout(2)
        order = torch.randperm(8, generator=torch.Generator().manual_seed(derive_seed(0, 2, 0, SHUFFLE)))
        poisoned = int(
            order[1]
        )  # the first mini-batch's micro-batches are order[0], [1], [2], [3]: rank 1 runs [1]
        batch.logp_sampler[poisoned, 0] = float("nan")
        a, b = one.learn(2, batch), two.learn(2, batch)
        print(f"step 2: max |1 learner - 2 learners| = {max_abs_diff(weights(one), weights(two)):.3g}")
        assert (
            a["train/nonfinite_skipped_updates"] == b["train/nonfinite_skipped_updates"] == 2.0
        )  # one an epoch
        assert max_abs_diff(weights(one), weights(two)) <= (TOLERANCE if held == "copies" else FSDP_TOLERANCE)
        assert torch.equal(
            one.optimizer.state_dict()["state"][0]["step"], two.optimizer.state_dict()["state"][0]["step"]
        )
    finally:
        one.close()
        two.close()


def learners(n: int, fsdp: bool) -> list[str]:
    return [f"distributed.learners={n}", *(["distributed.fsdp=true"] if fsdp and n > 1 else [])]


def test_a_checkpoint_resumes_with_another_number_of_learners(tmp_path):
    """Steps 1-2 with N learners, steps 3-4 resumed with M: the weights of 1 learner throughout (bit for bit
    here with copies: one micro-batch a rank), and the metrics of the steps after the resume. Sharded ranks
    (FSDP) save and resume the one-learner format too."""
    straight = make_trainer(tiny_cfg(tmp_path, "optim.schedule=cosine", name="straight"))
    straight.train()
    for first, then, fsdp in ((2, 1, False), (1, 2, False), (2, 1, True), (1, 2, True)):
        name = f"n{first}to{then}" + ("-fsdp" if fsdp else "")
        cfg = tiny_cfg(tmp_path, "optim.schedule=cosine", *learners(first, fsdp), name=name)
        with make_trainer(cfg) as killed:
            killed.train(until_step=2)  # as if killed right after step 2's checkpoint
        cfg = tiny_cfg(tmp_path, "optim.schedule=cosine", *learners(then, fsdp), name=name)
        with make_trainer(cfg, run_dir=tmp_path / name, resume=True) as resumed:
            assert resumed.state.step == 2
            resumed.train()
        diff = max_abs_diff(weights(straight), weights(resumed))
        print(f"{name}: max |straight - resumed| = {diff:.3g}")
        assert diff <= (FSDP_TOLERANCE if fsdp else 0), name
        expected = {r["step"]: r for r in rows(tmp_path / "straight") if "reward/mean" in r}
        got = {r["step"]: r for r in rows(tmp_path / name) if "reward/mean" in r}
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/lr"):
            assert got[4][key] == pytest.approx(expected[4][key], rel=1e-6 if not fsdp else 1e-4), (name, key)


def test_rollout_workers_sample_with_the_ranks_weights(tmp_path):
    """Rank 0's weights reach the rollout workers through the trainer's policy: step 2's samples (after an update
    by 2 learners) are those of one process with one learner."""
    local, _, _ = two_steps(tmp_path, "local")
    extra = ("distributed.learners=2", "distributed.cpus_per_learner=0.5", "distributed.rollout_workers=1")
    remote, _, _ = two_steps(tmp_path, "ray", *extra)
    assert remote[1].completions == local[1].completions
    torch.testing.assert_close(remote[1].logp_sampler, local[1].logp_sampler, atol=1e-5, rtol=0)


def test_the_summary_counts_the_memory_of_every_process_of_the_run(tmp_path):
    """Learner ranks and rollout workers each hold a model copy: the summary reports each process's peak and
    their sum, not the driver's alone."""
    from sparserl.trainer.logging import memory_text

    extra = ("distributed.learners=2", "distributed.cpus_per_learner=0.5", "distributed.rollout_workers=1")
    with make_trainer(tiny_cfg(tmp_path, "trainer.steps=1", "trainer.eval_prompts=0", *extra)) as trainer:
        summary = trainer.train()
    peaks = summary["peak_rss_bytes_by_process"]
    assert sorted(peaks) == ["learner rank 0", "learner rank 1", "rollout worker 0", "trainer"]
    assert min(peaks.values()) > 50 * 2**20 and summary["peak_rss_bytes_all_processes"] == sum(peaks.values())
    assert "summed over 4 processes (trainer " in memory_text(summary)


def test_learner_settings_that_cannot_run_name_their_key():
    with pytest.raises(ConfigError, match=r"optim.grad_accum=3 must be a multiple of distributed.learners=2"):
        load_config(None, ["distributed.learners=2", "optim.grad_accum=3", "optim.mini_batch_size=8"])
    with pytest.raises(ConfigError, match="distributed.learners=0 must be >= 1"):
        load_config(None, ["distributed.learners=0"])


def test_learners_that_cannot_all_start_are_named_within_seconds(tmp_path):
    extra = (
        "distributed.learners=3",
        "optim.grad_accum=3",
        "optim.mini_batch_size=8",
        "distributed.start_timeout_s=3",
    )
    with pytest.raises(RuntimeError, match=r"3 learners cannot all be placed: each asks for 1 CPUs.*2 CPUs"):
        make_trainer(tiny_cfg(tmp_path, *extra))
    deadline = time.monotonic() + 30  # Ray frees a removed placement group's CPUs asynchronously
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2  # the placement group was removed
