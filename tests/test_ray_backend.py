"""The `ray` rollout backend on a local 2-CPU Ray: token-identical samples with 0, 1 and 2 workers (also after a
weight push), a stale version refused, a killed worker replaced without losing or duplicating a sample, an
unschedulable request named within seconds, and no Ray at all without distributed keys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

from sparserl.rollout import StaleWeights  # noqa: E402
from tests.ray_cluster import local_ray  # noqa: E402, F401 - the module's local Ray
from tests.test_trainer import make_trainer, tiny_cfg  # noqa: E402


def two_steps(tmp_path, name: str, *extra: str):
    """Rollouts of steps 1 and 2 (a learner step between: the workers get the new weights)."""
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=2", *extra, name=name))
    try:
        first, _ = trainer.rollout(1)
        trainer.learn(1, first)
        trainer.state.step = 1
        second, metrics = trainer.rollout(2)
        return [first, second], metrics, trainer
    finally:
        trainer.close()


def test_zero_one_and_two_workers_give_the_same_samples(tmp_path):
    local, _, _ = two_steps(tmp_path, "local")
    for workers in (1, 2):
        remote, metrics, _ = two_steps(tmp_path, f"w{workers}", f"distributed.rollout_workers={workers}")
        assert metrics["rollout/worker_restarts"] == 0
        for a, b in zip(local, remote, strict=True):
            assert a.completions == b.completions
            torch.testing.assert_close(a.logp_sampler, b.logp_sampler, atol=1e-5, rtol=0)


def test_a_worker_refuses_a_version_it_does_not_hold(tmp_path):
    trainer = make_trainer(tiny_cfg(tmp_path, "distributed.rollout_workers=1"))
    try:
        backend = trainer.rollouts.backend
        with pytest.raises(StaleWeights):
            backend.check_version(3)
        with pytest.raises(ray.exceptions.RayTaskError, match="holds the weights of policy version 0"):
            ray.get(backend.workers[0].run.remote([], None, 3, 0))
    finally:
        trainer.close()


def test_a_killed_worker_is_replaced_and_no_sample_is_lost_or_duplicated(tmp_path):
    extra = ("distributed.rollout_workers=2", "rollout.prompts_per_step=4")
    clean, _, _ = two_steps(tmp_path, "clean", *extra)
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=2", *extra, name="killed"))
    try:
        first, _ = trainer.rollout(1)
        trainer.learn(1, first)
        trainer.state.step = 1
        os.kill(trainer.rollouts.backend.pids[1], signal.SIGKILL)
        second, metrics = trainer.rollout(2)
    finally:
        trainer.close()
    assert metrics["rollout/worker_restarts"] == 1
    assert second.completions == clean[1].completions  # the replacement got version 1's weights


def test_an_unschedulable_request_is_named_within_seconds(tmp_path):
    extra = ("distributed.rollout_workers=3", "distributed.start_timeout_s=3")
    with pytest.raises(
        RuntimeError, match=r"did not start within 3 s: each asks for 1 CPUs.*free in the Ray"
    ):
        make_trainer(tiny_cfg(tmp_path, *extra))


def test_without_distributed_keys_ray_is_never_imported(tmp_path):
    code = (
        "import sys; from tests.test_trainer import make_trainer, tiny_cfg; from pathlib import Path; "
        f"t = make_trainer(tiny_cfg(Path({str(tmp_path)!r}), 'trainer.steps=1')); t.train(); "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_a_run_keeps_its_sigterm_handler_when_it_starts_ray(tmp_path):
    """`sparserl train` saves the step on SIGTERM; a Ray started by the run must not take that over."""
    code = (
        "import signal, sys; from pathlib import Path; from sparserl.signals import StopOnSignal; "
        "from tests.test_trainer import make_trainer, tiny_cfg\n"
        "with StopOnSignal() as stop:\n"
        "    ours = signal.getsignal(signal.SIGTERM)\n"
        f"    t = make_trainer(tiny_cfg(Path({str(tmp_path)!r}), 'distributed.rollout_workers=1'))\n"
        "    assert signal.getsignal(signal.SIGTERM) is ours, 'Ray replaced the handler'\n"
        "    t.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_shares_cut_only_between_groups():
    from sparserl.rollout.ray_backend import split

    groups = [[g] for g in (1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 4)]
    shares = split(groups, 2)
    assert [len(s) for s in shares] == [6, 6] and sum(map(len, split(groups, 3))) == 12
    for share in split(groups, 3):
        assert share.start == 0 or groups[share.start] != groups[share.start - 1]
    assert split([[1]] * 5, 2) == [range(0, 5)]  # one group: one worker
