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
from sparserl.rollout import RESUMED, SAMPLED, PromptSource, RolloutLayer, SampleRecord, Scheduler

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


def test_record_segments_versions_origins_and_masks():
    s = SampleRecord(prompt_id=3, group_id=0, sample_index=1, seed=1, key=13)
    s.extend([5, 6], [-0.1, -0.2], version=0)
    s.extend([7], [-0.3], version=2)
    s.check()
    assert s.origins == [RESUMED, RESUMED, SAMPLED] and s.versions == [0, 0, 2]
    assert (s.start_version, s.end_version) == (0, 2)
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
    e.on_step = lambda step, cache, samples: seen.append((cache.nbytes(), cache.rows))
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
    e.on_step = lambda step, cache, samples: seen.append((cache.capacity, cache.rows, cache.nbytes()))
    run, _, stats = Scheduler(e, cap).run(requests([300, 200, 150, 10], n=4), Sampling())
    assert {c for c, _, _ in seen} >= {128, 256}  # grew in blocks
    assert max(b for _, _, b in seen) <= cap
    assert stats.preemptions >= 1 and stats.cap_truncated == 1  # the 300-token row alone outgrows the cap
    assert run.finish[0] == "length" and len(run.completion(0)[0]) < 300


def test_a_cap_too_small_for_one_sequence_names_both_sizes():
    e = engine()
    with pytest.raises(ValueError, match=r"kv_memory_cap=1.00 KiB is too small.*prompt of \d+ tokens.*needs"):
        Scheduler(e, 1024).run(requests([4]), Sampling())


def test_static_batching_waits_for_the_whole_batch():
    e = engine()
    reqs = requests([30, 5, 30, 5], n=4)
    cap = e.start_run(reqs, Sampling()).bytes_after_admit([0, 1], whole=True)  # two whole sequences
    rows = []
    e.on_step = lambda step, cache, samples: rows.append(cache.rows)
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


def source(lengths, taken: list[int]) -> PromptSource:
    ps = prompts(64, seed=1)

    def take(k: int) -> list[int]:
        rows = list(range(len(taken), len(taken) + k))
        taken.extend(rows)
        return rows

    return PromptSource(
        take=take,
        prompt_ids=lambda row: ps[row % len(ps)],
        example=lambda row: row,
        score=lambda texts, examples: [float(len(t)) for t in texts],
        decode=lambda ids: ["x" * len(t) for t in ids],
        max_new_tokens=lambda row, j: lengths[(row * 7 + j) % len(lengths)],
    )


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
    layer = RolloutLayer(e, cfg)
    taken: list[int] = []
    src = source(lengths, taken)
    returned: list[int] = []
    for version in range(4):
        groups, metrics, _ = layer.collect(version, 100 + version, src)
        assert len(groups) == 2 and all(g.complete for g in groups)
        for g in groups:
            returned.append(g.prompt_id)
            for s in g.samples:
                s.check()
                assert s.reward == float(len(s.tokens)) and len(s.tokens) == src.max_new_tokens(
                    g.prompt_id, s.sample_index
                )
                if mode == "mask_old":
                    assert all(m == (v == version) for m, v in zip(s.loss_mask, s.versions, strict=True))
        assert 0 <= metrics["off_policy_token_frac"] <= 1
    leftover = [d["prompt_id"] for d in layer.state.leftover]
    assert len(set(returned)) == len(returned), "a group returned twice"
    assert sorted(returned + leftover) == taken, "every prompt taken is returned or kept, none lost"
    layer.close()


def test_partial_rollouts_stop_early_keep_the_rest_and_report_staleness():
    e = engine()
    cfg = RolloutConfig(
        prompts_per_step=2, n=2, partial=PartialConfig(enable=True, over_provision=2.0, max_staleness=5)
    )
    layer = RolloutLayer(e, cfg)
    lengths = [3, 3, 40, 40]  # rows 0 and 2 short... rows (row*7 + j) % 4
    src = source(lengths, [])
    _, first, _ = layer.collect(0, 1, src)
    assert first["partial_buffer_groups"] >= 1 and first["off_policy_token_frac"] == 0
    _, later, _ = layer.collect(1, 2, src)
    _, last, _ = layer.collect(2, 3, src)
    assert max(later["staleness_max"], last["staleness_max"]) >= 1
    assert max(later["recycled_frac"], last["recycled_frac"]) > 0
    layer.close()


def test_stale_leftovers_are_dropped_and_counted():
    e = engine()
    cfg = RolloutConfig(
        prompts_per_step=1, n=2, partial=PartialConfig(enable=True, over_provision=3.0, max_staleness=0)
    )
    layer = RolloutLayer(e, cfg)
    src = source([2, 30], [])
    layer.collect(0, 1, src)
    kept = len(layer.state.leftover)
    _, metrics, _ = layer.collect(1, 2, src)
    assert kept >= 1 and metrics["partial_dropped_groups"] >= 1
    layer.close()


def test_async_rewards_equal_sync_ones():
    out = []
    for asynchronous in (True, False):
        cfg = RolloutConfig(prompts_per_step=3, n=2, async_rewards=asynchronous)
        layer = RolloutLayer(engine(), cfg)
        groups, _, _ = layer.collect(0, 5, source([4, 9, 13], []))
        out.append([(s.tokens, s.reward) for g in groups for s in g.samples])
        layer.close()
    assert out[0] == out[1]


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
    with pytest.raises(ConfigError, match="engine.compile=true.*kv_memory_cap"):
        config_from_dict(
            {"rollout": {"kv_memory_cap": "1GiB"}, "engine": {"compile": True}, "algo": {"preset": "dense"}}
        )


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
    saved = first.state.rollout["leftover"]
    assert saved, "an over-provisioned step leaves groups for the next"
    resumed = make_trainer(
        tiny_cfg(tmp_path, *extra, name="killed"), run_dir=tmp_path / "killed", resume=True
    )
    assert resumed.rollouts.state.leftover == saved
    resumed.train()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.rollouts.state == resumed.rollouts.state
    ra = {r["step"]: r for r in rows(tmp_path / "straight") if "reward/mean" in r}
    rb = {r["step"]: r for r in rows(tmp_path / "killed") if "reward/mean" in r}
    for key in ("reward/mean", "actor/loss", "rollout/off_policy_token_frac", "rollout/occupancy"):
        assert ra[4].get(key) == rb[4].get(key), key  # occupancy is absent when leftovers filled the step
    assert max(r["rollout/recycled_frac"] for r in ra.values()) > 0
    assert all(0 < r["rollout/occupancy"] <= 1 for r in ra.values() if "rollout/occupancy" in r)
    assert ra[1]["rollout/occupancy"] > 0
