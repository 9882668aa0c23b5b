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

from sparserl.distributed.weights import trainable_state  # noqa: E402
from sparserl.rollout import StaleWeights  # noqa: E402
from tests.ray_cluster import local_ray, ray_cpus_free  # noqa: E402, F401 - the module's local Ray
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
            # the same tokens; the log-probs to float32 round-off of a process of its own (measured: 1.5e-5 on an
            # AVX512 machine with the code of the previous release, 0 on the one this test was written on)
            torch.testing.assert_close(a.logp_sampler, b.logp_sampler, atol=1e-4, rtol=0)


def test_a_worker_refuses_a_version_it_does_not_hold(tmp_path):
    trainer = make_trainer(tiny_cfg(tmp_path, "distributed.rollout_workers=1"))
    try:
        backend = trainer.rollouts.backend
        with pytest.raises(StaleWeights):
            backend.check_version(3)
        with pytest.raises(ray.exceptions.RayTaskError, match="holds the weights of policy version 0"):
            ray.get(backend.workers[0].run.remote([], None, 3, 0))
        with pytest.raises(ValueError, match=r"push_weights\(1, state\) needs the tensors that changed"):
            backend.push_weights(1)  # its workers hold copies: a version without its weights is refused
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


@pytest.mark.parametrize("trained", ["full", "lora"])
def test_broadcast_weights_give_the_in_process_samples(tmp_path, trained):
    """distributed.weight_sync=broadcast (a gloo group of the trainer and 2 workers here): step 2's samples, drawn
    with the broadcast weights of version 1, are the in-process backend's; with LoRA only the adapter travels."""
    extra = ["model.lora=true", "model.lora_r=4", "optim.lr=1e-2"] if trained == "lora" else []
    local, _, _ = two_steps(tmp_path, f"local-{trained}", *extra)
    sync = ("distributed.rollout_workers=2", "distributed.weight_sync=broadcast")
    remote, _, trainer = two_steps(tmp_path, f"broadcast-{trained}", *extra, *sync)
    assert trainer.rollouts.backend.sync.name == "broadcast"
    sent = trainer.rollouts.backend.state
    assert all(("lora_" in name) == (trained == "lora") for name in sent)
    for a, b in zip(local, remote, strict=True):
        assert a.completions == b.completions
        torch.testing.assert_close(a.logp_sampler, b.logp_sampler, atol=1e-4, rtol=0)  # as above: round-off


def test_a_bfloat16_broadcast_lands_in_float32_weights(tmp_path):
    """A state pushed in bfloat16 (half the bytes on the wire) is received in bfloat16 and copied into the
    workers' float32 weights: they hold exactly its values."""
    extra = ("distributed.rollout_workers=2", "distributed.weight_sync=broadcast")
    trainer = make_trainer(tiny_cfg(tmp_path, *extra))
    try:
        state = {k: (v + 0.01).to(torch.bfloat16) for k, v in trainable_state(trainer.policy.module).items()}
        trainer.rollouts.backend.push_weights(1, state)
        for worker in trainer.rollouts.backend.workers:
            held = ray.get(
                worker.__ray_call__.remote(lambda w: dict(w.backend.engine.model.named_parameters()))
            )
            assert all(
                held[k].dtype == torch.float32 and torch.equal(held[k], v.float()) for k, v in state.items()
            )
    finally:
        trainer.close()


def test_killed_workers_rejoin_the_weight_broadcast(tmp_path):
    """A worker killed before a share (replaced mid-run) and one killed before a push (replaced by the push):
    each time the group is formed anew and every worker ends at the last version, with the clean run's samples."""
    extra = (
        "distributed.rollout_workers=2",
        "rollout.prompts_per_step=4",
        "distributed.weight_sync=broadcast",
    )
    clean, _, _ = two_steps(tmp_path, "clean-broadcast", *extra)
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=2", *extra, name="killed-broadcast"))
    try:
        backend = trainer.rollouts.backend
        first, _ = trainer.rollout(1)
        trainer.learn(1, first)
        trainer.state.step = 1
        os.kill(backend.pids[1], signal.SIGKILL)
        second, metrics = trainer.rollout(2)
        os.kill(backend.pids[0], signal.SIGKILL)
        backend.push_weights(2, trainable_state(trainer.policy.module))
        for worker in backend.workers:  # each holds version 2 now
            with pytest.raises(ray.exceptions.RayTaskError, match="holds the weights of policy version 2"):
                ray.get(worker.run.remote([], None, 1, 0))
    finally:
        trainer.close()
    assert metrics["rollout/worker_restarts"] == 1 and backend.restarts == 2
    assert second.completions == clean[1].completions


def test_a_worker_dying_during_a_broadcast_is_replaced_and_the_push_made_again(tmp_path):
    """A worker killed after the push's liveness check (simulated: the check skipped once) breaks the collective;
    the push fails within distributed.start_timeout_s, the group is formed anew and every worker gets the version.
    (40 s: the new group's workers wait for the old ones' CPUs, which Ray gives back late on a loaded machine.)"""
    extra = (
        "distributed.rollout_workers=2",
        "distributed.weight_sync=broadcast",
        "distributed.start_timeout_s=40",
    )
    trainer = make_trainer(tiny_cfg(tmp_path, *extra))
    try:
        backend, state = trainer.rollouts.backend, trainable_state(trainer.policy.module)
        backend.push_weights(1, state)
        check, skipped = backend.replace_dead, []
        backend.replace_dead = lambda: skipped.append(1) if not skipped else check()
        os.kill(backend.pids[1], signal.SIGKILL)
        backend.push_weights(2, state)
        for worker in backend.workers:
            with pytest.raises(ray.exceptions.RayTaskError, match="holds the weights of policy version 2"):
                ray.get(worker.run.remote([], None, 1, 0))
    finally:
        trainer.close()
    assert skipped and backend.restarts == 1


def test_an_unschedulable_request_is_named_within_seconds(tmp_path):
    """More than the cluster has in all is named at once; what it has but is busy, after start_timeout_s."""
    from ray.util.placement_group import placement_group, remove_placement_group

    with pytest.raises(
        RuntimeError, match=r"3 rollout workers cannot all be placed: .*2 CPUs and 0 GPUs in all"
    ):
        make_trainer(tiny_cfg(tmp_path, "distributed.rollout_workers=3"))
    busy = placement_group([{"CPU": 1}])  # holds one of the 2 CPUs
    try:
        ray.get(busy.ready())
        extra = ("distributed.rollout_workers=2", "distributed.start_timeout_s=3")
        with pytest.raises(
            RuntimeError, match=r"did not start within 3 s: each asks for 1 CPUs.*free in the Ray"
        ):
            make_trainer(tiny_cfg(tmp_path, *extra))
    finally:
        remove_placement_group(busy)


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


def test_rewards_are_scored_on_the_workers(tmp_path):
    """With rollout workers the layer's reward worker is theirs: the same rewards (so the same advantages) and
    the same reward counters as scoring in this process."""
    from sparserl.rollout.ray_backend import WorkerRewards

    local, local_metrics, here = two_steps(tmp_path, "local-rewards")
    remote, metrics, trainer = two_steps(tmp_path, "w2-rewards", "distributed.rollout_workers=2")
    assert isinstance(trainer.rollouts.rewards, WorkerRewards)
    for a, b in zip(local, remote, strict=True):
        torch.testing.assert_close(a.advantages, b.advantages)
    assert metrics["reward/mean"] == local_metrics["reward/mean"]
    counters = {k: v for k, v in trainer.state.counters.items() if k.startswith("reward/")}  # the steps' own
    assert counters == {k: v for k, v in here.state.counters.items() if k.startswith("reward/")}
    assert counters.get("reward/calls", 0) > 0


def user_reward_view(tmp_path, monkeypatch, rewards: str = "[builtin, user_reward_mod:f]"):
    """A TaskView of the default task rewarded by `rewards`: the built-in reward plus a user function from a
    module in a folder of its own (on this process's sys.path), isolated in a reward process as `task.reward`
    makes it; `user_reward_mod:batch` rewards each completion with the size of the batch it came in."""
    from sparserl.config import load_config
    from sparserl.models import tiny_model
    from sparserl.rollout.task_view import TaskView
    from sparserl.tasks import make_task

    folder = tmp_path / "rewards_here"
    folder.mkdir()
    (folder / "user_reward_mod.py").write_text(
        "def f(completions, **kwargs):\n    return [0.5] * len(completions)\n\n\n"
        "def batch(completions, **kwargs):\n    return [float(len(completions))] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    cfg = load_config(None, [f"task.reward={rewards}"])
    task = make_task(cfg.task, "train")
    return TaskView(task, tiny_model("llama", seed=0)[1]), task, folder


def test_user_reward_functions_run_on_the_workers_and_unimportable_ones_are_named(tmp_path, monkeypatch):
    """A user's reward function travels to the workers by name (its reward process there loads it again) and
    scores as here; once its module cannot be imported any more, sending the task is one error naming it."""
    from sparserl.errors import UserError

    view, task, folder = user_reward_view(tmp_path, monkeypatch)
    texts, examples = ["\\boxed{3}", "no"], [task[0], task[0]]
    here = view.scores(texts, examples)
    trainer = make_trainer(tiny_cfg(tmp_path, "distributed.rollout_workers=1"))
    try:
        rewards = trainer.rollouts.backend.reward_worker(view, True)
        rewards.submit("g", view.scores, texts, examples)
        assert rewards.wait() == {"g": here}
        for path in folder.rglob("*"):  # the module is gone: a new reward process cannot import it
            if path.is_file():
                path.unlink()
        with pytest.raises(
            UserError, match=r"could not be loaded on a rollout worker .*user_reward_mod.*importable"
        ):
            trainer.rollouts.backend.reward_worker(view, True)
    finally:
        trainer.close()
        task.close()


@pytest.mark.parametrize("asynchronous", [True, False])
def test_without_async_rewards_each_worker_scores_its_share_in_one_call(tmp_path, monkeypatch, asynchronous):
    """rollout.async_rewards=false: the groups wait for the end of the round, then each worker scores its share
    of whole groups in one call (a reward function sees several groups at once); asynchronous, one group a call.
    The user function rewards each completion with the size of its batch: 4 groups of 2 on 2 workers."""
    view, task, _ = user_reward_view(tmp_path, monkeypatch, rewards="[user_reward_mod:batch]")
    trainer = make_trainer(tiny_cfg(tmp_path, "distributed.rollout_workers=2"))
    try:
        rewards = trainer.rollouts.backend.reward_worker(view, asynchronous)
        for g in range(4):
            rewards.submit(g, view.scores, ["a", "b"], [task[g], task[g]])
        got = rewards.wait()
    finally:
        trainer.close()
        task.close()
    assert got == {g: [2.0, 2.0] if asynchronous else [4.0, 4.0] for g in range(4)}
