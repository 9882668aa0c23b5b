"""The seams the next systems plug into: group sources (unique streams, state in the checkpoint, user
registration), advantages over group ids, transforms, backends; the README's examples run here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl.algo import advantages, grpo_advantages
from sparserl.rollout import FreshPrompts, SourceContext
from tests.test_conformance_sources import new_streams
from tests.test_trainer import make_trainer, rows, tiny_cfg, weights

README = Path(__file__).resolve().parent.parent / "README.md"


@settings(max_examples=40, deadline=None)
@given(num_rows=st.integers(1, 5), k=st.integers(1, 12), n=st.integers(1, 6), version=st.integers(0, 9))
def test_no_two_samples_of_a_step_share_a_stream(num_rows, k, n, version):
    """Fewer rows than groups per step: a row drawn twice gets its own streams each time, also when a step
    plans a second round (DAPO's refill). tests/test_conformance_sources.py checks every registered source."""
    source = FreshPrompts(SourceContext(rows=list(range(num_rows)), n=n, seed=3))
    for v in (version, version + 1):
        plans = source.plan(k, v)
        streams = new_streams(plans)
        assert len(streams) == len(set(streams)) == k * n
        assert all(
            p.keys == [p.row * n + j for j in range(n)]
            for p in plans
            if plans.index(p) == min(i for i, q in enumerate(plans) if q.row == p.row)
        )  # a row's first group keeps the key row * n + j
    second_round = new_streams(source.plan(k, version + 1))
    assert not set(second_round) & set(streams)


def test_a_row_drawn_twice_in_a_step_samples_different_tokens(tmp_path):
    trainer = make_trainer(tiny_cfg(tmp_path, "rollout.max_new_tokens=8"))
    trainer.source.inner.choose = lambda k, version: [5] * k
    batch, _ = trainer.rollout(1)
    assert batch.completions[:4] != batch.completions[4:8]


@settings(max_examples=30, deadline=None)
@given(
    groups=st.integers(1, 5),
    size=st.integers(2, 6),
    estimator=st.sampled_from(["grpo", "drgrpo", "rloo"]),
    data=st.data(),
)
def test_group_ids_give_the_fixed_reshape_where_sizes_are_equal(groups, size, estimator, data):
    r = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=groups * size,
                                        max_size=groups * size)))  # fmt: skip
    fixed = grpo_advantages(r, size, estimator)
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(groups))
    index = torch.arange(len(r)) // size
    shuffled = advantages(r[perm], index[perm], estimator)
    assert torch.equal(shuffled, fixed[perm])  # any order of the samples


def test_groups_of_different_sizes():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0, 1.0, 2.0])
    adv = advantages(r, [0, 0, 1, 1, 1, 2], "drgrpo")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 3 - 5 / 3, 1 - 5 / 3, 1 - 5 / 3, 0.0]))


def test_the_lr_schedule_follows_the_batch_it_gets(tmp_path):
    """A batch of another size moves along the same lr curve: the horizon is trainer.steps x its updates."""
    trainer = make_trainer(tiny_cfg(tmp_path, "optim.schedule=linear", "trainer.steps=4"))
    learner = trainer.learner
    for size, step in ((8, 2), (16, 3)):
        per_step = learner.optimizer_steps(size)
        learner._schedule_at(step, per_step)
        assert abs(learner.scheduler.get_last_lr()[0] - 1e-3 * (1 - (step - 1) / 4)) < 1e-12


def _readme_block(marker: str) -> str:
    """The README's python block that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_readme_group_source_runs_and_resumes_exactly(tmp_path):
    scope: dict = {}
    exec(_readme_block("register_group_source"), scope)  # registers "easy_first"
    extra = ["sampling.method=easy_first", "trainer.save_every=1"]
    straight = make_trainer(tiny_cfg(tmp_path, *extra, name="straight"))
    straight.train()
    killed = make_trainer(tiny_cfg(tmp_path, *extra, name="killed"))
    killed.train(until_step=2)
    killed.close()
    resumed = make_trainer(
        tiny_cfg(tmp_path, *extra, name="killed"), run_dir=tmp_path / "killed", resume=True
    )
    assert resumed.source.state_dict() == killed.source.state_dict()
    resumed.train()
    assert straight.source.state_dict() == resumed.source.state_dict()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.source.inner.seen_rewards, "observe() received the scored groups"


def test_readme_advantage_transform_runs(tmp_path):
    scope: dict = {}
    exec(_readme_block("register_adv_transform"), scope)  # registers "length_penalty"
    trainer = make_trainer(tiny_cfg(tmp_path, "algo.adv_transforms=[length_penalty]", "trainer.steps=1"))
    trainer.train()
    assert [r for r in rows(tmp_path / "run") if "adv/abs_mean" in r]


def test_readme_backend_runs(tmp_path):
    scope: dict = {}
    exec(_readme_block("register_backend"), scope)  # registers "counting"
    trainer = make_trainer(tiny_cfg(tmp_path, "rollout.backend=counting", "trainer.steps=2"))
    trainer.train()
    assert trainer.rollouts.backend.runs == 2


def test_a_checkpoint_written_before_the_sources_had_parts_resumes_exactly(tmp_path):
    """Older checkpoints kept the data position and the leftover groups in trainer_state.json: they are moved
    into the source's part on load, and the resumed run ends where an uninterrupted one does."""
    import json
    import shutil

    from sparserl.trainer import latest_checkpoint

    extra = ["rollout.partial.enable=true", "rollout.partial.max_staleness=3", "trainer.steps=3"]
    straight = make_trainer(tiny_cfg(tmp_path, *extra, name="straight"))
    straight.train()
    old = make_trainer(tiny_cfg(tmp_path, *extra, name="old"))
    old.train(until_step=2)
    old.close()
    ckpt = latest_checkpoint(tmp_path / "old")
    part = json.loads((ckpt / "source" / "state.json").read_text())
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["data_position"] = part["inner"]["position"]
    state["rollout"].update(leftover=part["leftover"], dropped_groups=part["dropped_groups"])
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    shutil.rmtree(ckpt / "source")
    resumed = make_trainer(tiny_cfg(tmp_path, *extra, name="old"), run_dir=tmp_path / "old", resume=True)
    resumed.train()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.source.state_dict() == resumed.source.state_dict()


def test_a_checkpoint_written_before_the_addons_had_parts_resumes_exactly(tmp_path):
    """Older checkpoints kept DistillSparse's probe in trainer_state.json under the add-on's name: it is moved
    into the add-on's part on load, and the resumed run's adapter and probe metrics equal an uninterrupted
    run's. An entry that names neither a field nor a part is refused by name."""
    import json

    from sparserl.trainer import latest_checkpoint, load_checkpoint
    from tests.test_distill import distill_cfg, make

    straight = make(distill_cfg(tmp_path, "distill.probe_every=1", name="straight"))
    straight.train()
    old = make(distill_cfg(tmp_path, "distill.probe_every=1", name="old"))
    old.train(until_step=2)
    old.close()
    ckpt = latest_checkpoint(tmp_path / "old")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["distill"] = json.loads((ckpt / "distill" / "state.json").read_text())
    assert state["distill"]["probe"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "distill" / "state.json").unlink()
    resumed = make(distill_cfg(tmp_path, "distill.probe_every=1", name="old"), run_dir=tmp_path / "old",
                   resume=True)  # fmt: skip
    resumed.train()
    name = straight.policy.distill_adapter
    a, b = straight.policy.adapter_weights(name), resumed.policy.adapter_weights(name)
    assert all(torch.equal(a[k], b[k]) for k in a)

    def last_probe(run: str) -> dict:  # step 3's alpha tail on the probe, before and after the update
        probes = [
            {k: v for k, v in r.items() if "alpha_p5" in k} for r in rows(tmp_path / run) if r["step"] == 3
        ]
        return [p for p in probes if p][-1]

    assert last_probe("straight") == last_probe("old")
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, "mystery": {"x": 1}}))
    with pytest.raises(RuntimeError, match="'mystery'"):
        load_checkpoint(ckpt)
    straight.close()
    resumed.close()


def test_an_unknown_source_or_backend_is_named(tmp_path):

    from sparserl.errors import UserError

    for key in ("sampling.method", "rollout.backend"):
        with pytest.raises(UserError, match=rf"{key}='nope' is unknown; choose one of"):
            make_trainer(tiny_cfg(tmp_path, f"{key}=nope"))
        assert not (tmp_path / "run").exists()  # no run directory left behind


def test_backend_capabilities_are_read_not_its_name():
    """A config asking for what the run's backend does not declare is refused, naming the keys: whatever the
    backend's name (a registered one without recording or early stop here)."""

    from sparserl.config import load_config
    from sparserl.config.errors import ConfigError
    from sparserl.rollout import BACKENDS, LocalBackend, check_backend, register_backend

    @register_backend("test_plain")
    class Plain(LocalBackend):
        records = partial_stop = False

    try:
        check_backend(load_config(None, ["rollout.backend=test_plain"]))
        for key in ("trainer.log_acceptance=true", "rollout.partial.enable=true"):
            with pytest.raises(ConfigError, match=rf"'test_plain' cannot run with {key.split('=')[0]}"):
                check_backend(load_config(None, ["rollout.backend=test_plain", key]))
        check_backend(load_config(None, ["trainer.log_acceptance=true"]))  # the local backend records
    finally:
        del BACKENDS["test_plain"]
