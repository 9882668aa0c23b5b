"""FSDP ranks train a batch whose size is not the config's (DARS, trees, SAPO make it vary): a short mini-batch
leaves a micro-batch empty, and the rank that would run it takes a zero-loss pass instead, so every rank runs as
many forwards and backwards and the update is one learner's."""

from __future__ import annotations

import dataclasses

import pytest

ray = pytest.importorskip("ray")

from sparserl.trainer.update import Batch  # noqa: E402
from tests.ray_cluster import local_ray, ray_cpus_free  # noqa: E402, F401 - the module's local Ray
from tests.test_learner_group import FSDP_TOLERANCE, max_abs_diff  # noqa: E402
from tests.test_trainer import make_trainer, tiny_cfg, weights  # noqa: E402


def first_rows(batch: Batch, k: int) -> Batch:
    """The batch's first `k` samples: a batch of another size than prompts_per_step x n."""
    cut = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return Batch(**{name: None if v is None else v[:k] for name, v in cut.items()})


def test_fsdp_ranks_train_a_short_mini_batch_as_one_learner(tmp_path) -> None:
    extra = ("optim.grad_accum=4", "optim.mini_batch_size=4", "algo.correction_mode=bypass")
    one = make_trainer(tiny_cfg(tmp_path, *extra, name="one"))
    two = make_trainer(
        tiny_cfg(tmp_path, *extra, "distributed.learners=2", "distributed.fsdp=true", name="two")
    )
    try:
        batch, _ = one.rollout(1)
        short = first_rows(batch, 7)  # mini-batches of 4 and 3 rows: the second's fourth micro-batch is empty
        a, b = one.learn(1, short), two.learn(1, short)
        assert a["train/nonfinite_skipped_updates"] == b["train/nonfinite_skipped_updates"] == 0.0
        assert max_abs_diff(weights(one), weights(two)) <= FSDP_TOLERANCE
        assert b["actor/loss"] == pytest.approx(a["actor/loss"], rel=1e-5, abs=1e-7)
    finally:
        one.close()
        two.close()
