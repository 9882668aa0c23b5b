"""The rollout layer on tiny models: records, continuous batching under a KV memory cap, partial rollouts."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparserl.config import ConfigError, config_from_dict
from sparserl.config.rollout import PartialConfig, RolloutConfig, parse_bytes
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.decoding import Request, Sampling
from sparserl.models import tiny_model
from sparserl.rollout import (
    GroupPlan,
    GroupSource,
    LeftoverBuffer,
    LocalBackend,
    RolloutLayer,
    SampleRecord,
    Scheduler,
    SourceContext,
)

LOGP_TOL = (
    1e-5  # fp32 on CPU: a row's log-probs alone vs in another batch differ by ~1e-6 (batch non-invariance)
)


@functools.cache
def tiny():
    return tiny_model("llama", seed=0)


def engine(kv: KVConfig | None = None) -> RolloutEngine:
    model, tok = tiny()
    e = RolloutEngine(model, tok, kv=kv)
    e.eos_ids = set()  # lengths come from each request's cap
    return e


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(10, 250, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 30, (count,), generator=g)
    ]


def requests(lengths: list[int], n: int = 3) -> list[Request]:
    ps = prompts(len(lengths) // n + 1)
    return [Request(ps[i // n], key=i, seed=7, max_new_tokens=length) for i, length in enumerate(lengths)]


def finished_tokens(run) -> list[tuple[list[int], torch.Tensor]]:
    return [run.completion(i) for i in range(len(run.requests))]


# --- records --------------------------------------------------------------------------------------------------


def test_record_segments_versions_and_masks():
    s = SampleRecord(prompt_id=3, group_id=0, sample_index=1, seed=1, key=13)
    s.extend([5, 6], [-0.1, -0.2], version=0)
    s.extend([7], [-0.3], version=2)
    assert s.versions == [0, 0, 2] and s.start_version == 0
    s.mask_stale(2)
    assert s.loss_mask == [0, 0, 1] and len(s.loss_mask) == len(s.tokens)
    with pytest.raises(ValueError, match="version 1 after 2"):
        s.extend([8], [-0.4], version=1)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        s.extend([8, 9], [-0.4], version=3)


# --- continuous batching ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kv", [None, KVConfig(method="rkv", budget=12, window=4, interval=4)], ids=["dense", "rkv"]
)
def test_continuous_batching_gives_the_static_batch_samples(kv):
    """Same per-sample streams: a cap that holds a few rows at a time admits them as others finish (and, dense,
    preempts and re-prefills when the cache grows) and still draws the same tokens."""
    lengths = [5, 40, 9, 17, 3, 60, 22, 8, 31]
    e = engine(kv)
    static, _, _ = Scheduler(e).run(requests(lengths), Sampling())
    bpp = static.bytes_per_position
    cap = 3 * 128 * bpp if kv is None else 3 * (12 + 4 - 1) * bpp
    seen = []
    e.step_hooks.append(lambda step, cache, samples: seen.append((cache.nbytes(), cache.rows)))
    run, unfinished, stats = Scheduler(e, cap).run(requests(lengths), Sampling())
    assert not unfinished and stats.admissions >= len(lengths)
    assert max(b for b, _ in seen) <= cap, "the cap is never exceeded"
    assert max(rows for _, rows in seen) < len(lengths)  # sequences waited for memory
    for (a, la), (b, lb) in zip(finished_tokens(static), finished_tokens(run), strict=True):
        assert a == b
        torch.testing.assert_close(la, lb, atol=LOGP_TOL, rtol=0)
    assert [len(t) for t, _ in finished_tokens(run)] == lengths


def test_dense_cache_grows_with_its_longest_row_and_preempts_at_the_cap():
    e = engine()
    probe = e.start_run(requests([1]), Sampling())
    bpp = probe.bytes_per_position
    cap = 300 * bpp  # two rows of 128 slots fit, two of 256 do not, nor does one of 384
    seen = []
    e.step_hooks.append(
        lambda step, cache, samples: seen.append((cache.capacity, cache.rows, cache.nbytes()))
    )
    run, _, stats = Scheduler(e, cap).run(requests([300, 200, 150, 10], n=4), Sampling())
    assert {c for c, _, _ in seen} >= {128, 256}  # grew in blocks
    assert max(b for _, _, b in seen) <= cap
    assert stats.preemptions >= 1 and stats.cap_truncated == 1  # the 300-token row alone outgrows the cap
    assert run.finish[0] == "length" and len(run.completion(0)[0]) < 300


@pytest.mark.parametrize(
    "kv", [None, KVConfig(method="rkv", budget=16, window=4, interval=4)], ids=["dense", "rkv"]
)
def test_a_request_joining_a_full_run_is_charged_alone_against_the_cap(kv):
    """The cap check charges a sequence as an empty run would hold it (`bytes_alone`: on a fresh run, what
    admitting it alone charges), so a request added to a running run (a tree's child) whose rows are about to
    outgrow their block is not refused as too large for the cap: the running rows are preempted instead."""
    e = engine(kv)
    reqs = requests(
        [200, 200, 7, 7, 7], n=2
    )  # a group of two long rows, then a group of three sharing a prompt
    with e.decoding():
        fresh = e.start_run(reqs, Sampling(), kv_memory_cap=10**9)
        assert [fresh.bytes_alone(i) for i in range(5)] == [fresh.bytes_after_admit([i]) for i in range(5)]
        cap = 300 * fresh.bytes_per_position
        run = e.start_run(reqs[:2], Sampling(), kv_memory_cap=cap)
        run.admit([0, 1])
        while int(run.cache.length.max()) < run.cache.capacity:
            run.step()
        (child,) = run.extend([Request(reqs[0].prompt, 99, 7, 10, prefix=[5, 6])])
    assert cap >= run.bytes_alone(child)
    if kv is None:  # dense rows about to outgrow their block: beside them, the child is over the cap
        assert run.bytes_after_admit([child]) > cap
    children = {0: [Request(reqs[0].prompt, 99, 7, 10)], 1: [Request(reqs[0].prompt, 100, 7, 10)]}
    grown, _, _ = Scheduler(e, cap).run(reqs[:2], Sampling(), lambda run, i: children.pop(i, None))
    assert grown.finish == ["length"] * 4


def test_a_cap_too_small_for_one_sequence_names_both_sizes():
    e = engine()
    with pytest.raises(
        ConfigError, match=r"kv_memory_cap=1.00 KiB is too small.*prompt of \d+ tokens.*needs"
    ):
        Scheduler(e, 1024).run(requests([4]), Sampling())


def test_static_batching_waits_for_the_whole_batch():
    e = engine()
    reqs = requests([30, 5, 30, 5], n=4)
    cap = e.start_run(reqs, Sampling()).bytes_after_admit([0, 1], whole=True)  # two whole sequences
    rows = []
    e.step_hooks.append(lambda step, cache, samples: rows.append(cache.rows))
    run, _, stats = Scheduler(e, cap, "static").run(reqs, Sampling())
    assert max(rows) == 2 and stats.preemptions == 0
    assert rows.count(1) >= 24  # the short row finished; the batch waited for the long one before admitting


def test_resumed_sample_equals_the_uninterrupted_one_when_weights_do_not_change():
    e = engine()
    lengths = [25, 12, 40]
    whole, _, _ = Scheduler(e).run(requests(lengths), Sampling())
    steps = iter(range(1000))
    first, unfinished, _ = Scheduler(e).run(
        requests(lengths), Sampling(), should_stop=lambda: next(steps) >= 9
    )
    assert unfinished == [0, 1, 2]
    resumed = [
        Request(r.prompt, r.key, r.seed, r.max_new_tokens, prefix=first.completion(i)[0])
        for i, r in enumerate(requests(lengths))
    ]
    second, _, _ = Scheduler(e).run(resumed, Sampling())
    for i in range(3):
        tokens, logps = second.completion(i)
        assert first.completion(i)[0] + tokens == whole.completion(i)[0]
        torch.testing.assert_close(
            torch.cat([first.completion(i)[1], logps]), whole.completion(i)[1], atol=LOGP_TOL, rtol=0
        )


# --- the layer: groups, partial rollouts ------------------------------------------------------------------------


class ScriptedView:
    """A task view over random prompts: reward = completion length, texts of 'x's."""

    def __init__(self) -> None:
        self.ps = prompts(64, seed=1)

    def prompt_ids(self, row: int) -> list[int]:
        return self.ps[row % len(self.ps)]

    def example(self, row: int) -> int:
        return row

    def decode(self, ids: list[list[int]]) -> list[str]:
        return ["x" * len(t) for t in ids]

    def scores(self, texts: list[str], examples: list) -> list[float]:
        return [float(len(t)) for t in texts]


class ScriptedSource(GroupSource):
    """Rows 0, 1, 2... in order; sample j of row r is capped at lengths[(r * 7 + j) % len(lengths)]."""

    def __init__(self, lengths: list[int], n: int) -> None:
        super().__init__(SourceContext(rows=[], n=n, seed=0))
        self.lengths, self.taken = lengths, []

    def choose(self, k: int, version: int) -> list[int]:
        rows = list(range(len(self.taken), len(self.taken) + k))
        self.taken.extend(rows)
        return rows

    def cap(self, row: int, j: int) -> int:
        return self.lengths[(row * 7 + j) % len(self.lengths)]

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        plans = super().plan(k, version)
        for p in plans:
            p.max_new_tokens = [self.cap(p.row, j) for j in range(p.n)]
        return plans


class Harness:
    """A layer over the local backend with a scripted source behind the leftover buffer; `step` runs one."""

    def __init__(self, cfg: RolloutConfig, lengths: list[int], e: RolloutEngine | None = None) -> None:
        self.inner = ScriptedSource(lengths, cfg.n)
        self.source = LeftoverBuffer(self.inner, cfg.partial)
        self.layer = RolloutLayer(LocalBackend(e or engine(), cfg), ScriptedView(), cfg)

    def step(self, version: int, seed: int):
        self.layer.backend.push_weights(version)
        got = self.layer.collect(version, seed, self.source.plan(self.layer.cfg.prompts_per_step, version))
        self.source.observe(got.groups, got.leftover)
        return got.groups, {**got.metrics, **self.source.metrics()}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 30), min_size=3, max_size=12),
    over=st.sampled_from([1.0, 1.5, 2.0]),
    mode=st.sampled_from(["train_all", "mask_old"]),
    capped=st.booleans(),
)
def test_no_sample_is_lost_or_duplicated_across_steps(lengths, over, mode, capped):
    e = engine()
    bpp = e.start_run(requests([1]), Sampling()).bytes_per_position
    cfg = RolloutConfig(
        prompts_per_step=2, n=2, max_new_tokens=30, kv_memory_cap=str(3 * 128 * bpp) if capped else None,
        partial=PartialConfig(enable=over > 1, over_provision=over, mode=mode, max_staleness=100),
    )  # fmt: skip
    h = Harness(cfg, lengths, e)
    returned: list[int] = []
    for version in range(4):
        groups, metrics = h.step(version, 100 + version)
        assert len(groups) == 2 and all(g.complete for g in groups)
        for g in groups:
            returned.append(g.prompt_id)
            for s in g.samples:
                assert len(s.sampler_logps) == len(s.versions) == len(s.loss_mask) == len(s.tokens)
                assert s.versions == sorted(s.versions)
                assert s.reward == float(len(s.tokens)) and len(s.tokens) == h.inner.cap(
                    g.prompt_id, s.sample_index
                )
                if mode == "mask_old":
                    assert all(m == (v == version) for m, v in zip(s.loss_mask, s.versions, strict=True))
        assert 0 <= metrics["off_policy_token_frac"] <= 1
    leftover = [d["prompt_id"] for d in h.source.leftover]
    assert len(set(returned)) == len(returned), "a group returned twice"
    assert sorted(returned + leftover) == h.inner.taken, "every prompt taken is returned or kept, none lost"
    h.layer.close()


def test_partial_rollouts_stop_early_keep_the_rest_and_report_staleness():
    cfg = RolloutConfig(
        prompts_per_step=2, n=2, partial=PartialConfig(enable=True, over_provision=2.0, max_staleness=5)
    )
    h = Harness(cfg, [3, 3, 40, 40])  # rows (row*7 + j) % 4
    _, first = h.step(0, 1)
    assert first["rollout/partial_buffer_groups"] >= 1 and first["off_policy_token_frac"] == 0
    _, later = h.step(1, 2)
    _, last = h.step(2, 3)
    assert max(later["staleness_max"], last["staleness_max"]) >= 1
    assert max(later["recycled_frac"], last["recycled_frac"]) > 0
    h.layer.close()


def test_stale_leftovers_are_dropped_and_counted():
    cfg = RolloutConfig(
        prompts_per_step=1, n=2, partial=PartialConfig(enable=True, over_provision=3.0, max_staleness=0)
    )
    h = Harness(cfg, [2, 30])
    h.step(0, 1)
    kept = len(h.source.leftover)
    _, metrics = h.step(1, 2)
    assert kept >= 1 and metrics["rollout/partial_dropped_groups"] >= 1
    h.layer.close()


def test_async_rewards_equal_sync_ones():
    out = []
    for asynchronous in (True, False):
        h = Harness(RolloutConfig(prompts_per_step=3, n=2, async_rewards=asynchronous), [4, 9, 13])
        groups, _ = h.step(0, 5)
        out.append([(s.tokens, s.reward) for g in groups for s in g.samples])
        h.layer.close()
    assert out[0] == out[1]


def test_backend_refuses_a_version_it_does_not_hold():
    from sparserl.rollout import StaleWeights

    h = Harness(RolloutConfig(prompts_per_step=1, n=2), [4])
    with pytest.raises(
        StaleWeights, match="holds the weights of policy version 0 but was asked .* version 3"
    ):
        h.layer.collect(3, 0, h.source.plan(1, 3))
    h.layer.backend.push_weights(3)
    groups = h.layer.collect(3, 0, h.source.plan(1, 3)).groups
    assert all(v == 3 for s in groups[0].samples for v in s.versions)
    h.layer.close()


def test_recording_held_positions_under_a_kv_cap_is_refused_where_it_is_set_up():
    from sparserl.rollout import Recording

    cfg = RolloutConfig(prompts_per_step=1, n=2, kv_memory_cap="1MiB")
    with pytest.raises(ValueError, match="held positions.*kv_memory_cap"):
        RolloutLayer(
            LocalBackend(engine(KVConfig(method="rkv", budget=16)), cfg, Recording(held=True)),
            ScriptedView(),
            cfg,
        )


# --- config ---------------------------------------------------------------------------------------------------


def test_sizes_and_bad_settings():
    assert parse_bytes("4GiB", "k") == 4 * 2**30 and parse_bytes("1.5MB", "k") == 1_500_000
    assert parse_bytes(4096, "k") == 4096
    with pytest.raises(ConfigError, match="rollout.kv_memory_cap='4 parsecs' is not a size"):
        config_from_dict({"rollout": {"kv_memory_cap": "4 parsecs"}})
    with pytest.raises(ConfigError, match="over_provision=0.5 must be a finite number >= 1"):
        config_from_dict({"rollout": {"partial": {"over_provision": 0.5}}})
    with pytest.raises(ConfigError, match="must be non-empty"):
        config_from_dict({"rollout": {"stop": [""]}})
    with pytest.raises(ConfigError, match="finite number"):
        config_from_dict({"rollout": {"partial": {"over_provision": float("inf")}}})
    cfg = config_from_dict(  # compiled under a cap: tests/test_compile.py
        {"rollout": {"kv_memory_cap": "1GiB"}, "engine": {"compile": True}, "algo": {"preset": "dense"}}
    )
    assert cfg.engine.compile is True


# --- in training: metrics, checkpoint -----------------------------------------------------------------------------


def test_partial_rollouts_train_and_resume_exactly_with_their_leftovers(tmp_path):
    """The leftover groups are in every checkpoint: a run killed after step 2 and resumed ends with the same
    weights, metrics and leftovers as one run straight through."""
    from test_trainer import make_trainer, rows, tiny_cfg, weights

    extra = ["rollout.partial.enable=true", "rollout.partial.max_staleness=3", "rollout.kv_memory_cap=1MiB"]
    straight = make_trainer(tiny_cfg(tmp_path, *extra, name="straight"))
    straight.train()
    first = make_trainer(tiny_cfg(tmp_path, *extra, name="killed"))
    first.train(until_step=2)
    first.close()
    saved = first.source.leftover
    assert saved, "an over-provisioned step leaves groups for the next"
    resumed = make_trainer(
        tiny_cfg(tmp_path, *extra, name="killed"), run_dir=tmp_path / "killed", resume=True
    )
    assert resumed.source.leftover == saved
    resumed.train()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.rollouts.state == resumed.rollouts.state
    assert straight.source.state_dict() == resumed.source.state_dict()
    ra = {r["step"]: r for r in rows(tmp_path / "straight") if "reward/mean" in r}
    rb = {r["step"]: r for r in rows(tmp_path / "killed") if "reward/mean" in r}
    for key in ("reward/mean", "actor/loss", "rollout/off_policy_token_frac", "rollout/occupancy"):
        assert ra[4].get(key) == rb[4].get(key), key  # occupancy is absent when leftovers filled the step
    assert max(r["rollout/recycled_frac"] for r in ra.values()) > 0
    assert all(0 < r["rollout/occupancy"] <= 1 for r in ra.values() if "rollout/occupancy" in r)
    assert ra[1]["rollout/occupancy"] > 0


def test_a_kv_cap_below_one_prompt_is_refused_before_any_step(tmp_path):
    """Between the config's lower bound and a real prompt: refused when the trainer starts, no run directory
    left behind."""
    from test_trainer import make_trainer, tiny_cfg

    with pytest.raises(ConfigError, match="rollout.kv_memory_cap=4.00 KiB is too small for one sequence"):
        make_trainer(tiny_cfg(tmp_path, "rollout.kv_memory_cap=4096"))
    assert not (tmp_path / "run").exists()
