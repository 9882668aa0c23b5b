"""DARS, VCRL and DAPO's dynamic sampling on the group-source seam: the schedules against their closed forms,
VCRL's score, the rounds of a step (cap, no duplicated sample, enlarged groups), and exact resume."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from sparserl.config import load_config
from sparserl.config.errors import ConfigError
from sparserl.config.rollout import RolloutConfig
from sparserl.engine.decoding import Sampling
from sparserl.rollout import (
    GroupSource,
    RolloutBackend,
    RolloutLayer,
    Segment,
    SourceContext,
    make_group_source,
    register_group_source,
)
from sparserl.rollout.sampling import check_group_sources, dars_extra_samples, normalised_variance
from tests.test_trainer import make_trainer, rows, tiny_cfg, weights

# --- DARS's schedules ---------------------------------------------------------------------------------------


def closed_form(a: Fraction, n: int, n_max: int, schedule: str) -> int:
    """The paper code's schedules without std, in closed form (et N(1/(4a(1-a)) - 1), hw N(1-2a)/(2a))."""
    a = Fraction(1, 2 * n) if a == 0 else a
    if a >= Fraction(1, 2):
        return 0
    x = n * (1 / (4 * a * (1 - a)) - 1) if schedule == "et" else n * (1 - 2 * a) / (2 * a)
    return min(math.ceil(x), n_max - n)


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("schedule,n_max", [("et", 32), ("hw", 64)])
def test_dars_schedules_equal_their_closed_forms(n, schedule, n_max):
    for k in range(n + 1):
        a = Fraction(k, n)
        assert dars_extra_samples(a, n, n_max, schedule) == closed_form(a, n, n_max, schedule), (k, n)


def test_dars_examples_from_the_paper_code():
    assert dars_extra_samples(Fraction(1, 4), 8, 32, "et") == 3
    assert dars_extra_samples(Fraction(1, 4), 8, 64, "hw") == 8
    assert dars_extra_samples(Fraction(0), 8, 32, "et") == 24  # 27, capped at n_max - n
    assert dars_extra_samples(Fraction(0), 8, 64, "hw") == 56


@pytest.mark.parametrize("schedule", ["et", "hw"])
def test_dars_with_std_is_the_least_integer_at_or_above_the_schedule(schedule):
    for n in (8, 16):
        for k in range(1, n // 2):
            a = k / n
            s = 2 * math.sqrt(a * (1 - a))
            peak = n if schedule == "et" else 2 * (1 - a) * n
            want = (peak - n * s) / s
            got = dars_extra_samples(Fraction(k, n), n, 10**6, schedule, std=True)
            assert got - 1 < want <= got + 1e-9, (n, k, got, want)


def test_dars_ceil_is_exact_at_integers():
    # et at a = 1/2 - tiny, hw at a = 1/4 give exact integers in rationals (8 for hw); floats may not
    assert dars_extra_samples(Fraction(1, 4), 8, 100, "hw") == 8
    assert dars_extra_samples(Fraction(1, 4), 16, 100, "et") == math.ceil(Fraction(16, 3))


# --- VCRL's score ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("g", range(2, 17))
def test_vcrl_normalised_variance(g):
    for k in range(g + 1):
        p = normalised_variance([1.0] * k + [0.0] * (g - k))
        var = k * (g - k) / (g * (g - 1))
        var_max = g / (4 * (g - 1)) if g % 2 == 0 else (g + 1) / (4 * g)
        assert p == pytest.approx(var / var_max, abs=1e-12)
    assert normalised_variance([1.0] * (g // 2) + [0.0] * (g - g // 2)) == pytest.approx(1.0)
    assert normalised_variance([0.0] * g) == 0.0 == normalised_variance([1.0] * g)


# --- rounds of a step, on a scripted backend ------------------------------------------------------------------


class KeyedBackend(RolloutBackend):
    """Each sample's one token is a hash of its (seed, key): deterministic, and different per stream."""

    name = "keyed"

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def run(self, requests, sampling, version, seed, on_segment, stop=None):
        self.requests += len(requests)
        for i, r in enumerate(requests):
            on_segment(Segment(i, [(r.seed * 31 + r.key * 17) % 1009], [-1.0], "stop", version))
        return {}


class RowView:
    """Rows 0-3 are always wrong, rows 4-7 always right, the rest right on an odd token."""

    def prompt_ids(self, row: int) -> list[int]:
        return [1, 2, row]

    def example(self, row: int) -> int:
        return row

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [str(t[0]) for t in ids]

    def scores(self, texts: list[str], examples: list) -> list[float]:
        return [
            float(0 if r < 4 else 1 if r < 8 else int(t) % 2) for t, r in zip(texts, examples, strict=True)
        ]


def step_once(method: str, *extra: str, k: int = 4, version: int = 0, rows_: int = 40):
    cfg = load_config(
        None, [f"sampling.method={method}", "rollout.n=4", f"rollout.prompts_per_step={k}", *extra]
    )
    ctx = SourceContext(list(range(rows_)), cfg.rollout.n, 0, cfg)
    source = make_group_source(ctx)
    backend = KeyedBackend()
    layer = RolloutLayer(backend, RowView(), cfg.rollout, cfg.sampling.max_extra_rounds)
    return layer.collect_step(source, k, version, 7), source, backend


@pytest.mark.parametrize("method", ["fresh", "dars", "vcrl"])
@pytest.mark.parametrize("cap", [0, 1, 3])
def test_dynamic_sampling_refill_respects_its_cap_and_never_repeats_a_sample(method, cap):
    got, source, backend = step_once(method, "sampling.dynamic=true", f"sampling.max_extra_rounds={cap}")
    assert got.sampling["rounds"] <= 1 + cap
    samples = [s for g in got.groups for s in g.samples]
    streams = [(s.seed, s.key) for s in samples]
    assert len(streams) == len(set(streams))
    assert backend.requests == got.sampling["generated_samples"]
    assert len(got.groups) == 4  # a full batch: signal groups first, dropped ones fill the rest (counted)
    flat = sum(len({s.reward for s in g.samples}) == 1 for g in got.groups)
    assert flat == source.metrics()["sampling/dynamic_filled_groups"]


def test_dynamic_sampling_trades_rounds_for_signal():
    plain, _, _ = step_once("fresh", "sampling.max_extra_rounds=4")
    dynamic, _, _ = step_once("fresh", "sampling.dynamic=true", "sampling.max_extra_rounds=4")
    assert plain.sampling["rounds"] == 1
    assert dynamic.sampling["zero_variance_frac"] <= plain.sampling["zero_variance_frac"]
    assert dynamic.sampling["generated_samples"] >= plain.sampling["generated_samples"]


def test_dars_enlarges_hard_groups_on_their_own_group_id():
    got, source, _ = step_once("dars", "sampling.dars_keep_degenerate=true", k=8, rows_=8)
    sizes = {g.prompt_id: len(g.samples) for g in got.groups}
    extra = dars_extra_samples(Fraction(0), 4, 32, "et", std=True)  # algo.adv_estimator=grpo: with std
    assert extra == 3 and all(sizes[r] == 4 + extra for r in range(4))  # all wrong
    assert all(sizes[r] == 4 for r in range(4, 8))  # all right: no extras
    for g in got.groups:
        assert {s.group_id for s in g.samples} == {g.group_id}
        assert [s.sample_index for s in g.samples] == list(range(len(g.samples)))
    m = source.metrics()
    assert m["sampling/dars_extra_samples"] == 4 * extra and m["sampling/dars_hard_prompts"] == 4


def test_dars_drops_degenerate_groups_unless_asked():
    got, _, _ = step_once("dars", k=12, rows_=12)  # rows 0-3 all wrong, 4-7 all right, 8-11 mixed
    trained = {g.prompt_id for g in got.groups}
    assert trained and trained <= set(range(8, 12))
    assert all(len({s.reward for s in g.samples}) > 1 for g in got.groups)
    assert got.sampling["dropped_groups"] == 12 - len(trained)


def test_vcrl_banks_high_variance_prompts_and_replays_them():
    cfg = load_config(None, ["sampling.method=vcrl", "rollout.n=4", "sampling.max_extra_rounds=0"])
    source = make_group_source(SourceContext(list(range(40)), 4, 0, cfg))
    layer = RolloutLayer(KeyedBackend(), RowView(), cfg.rollout, 0)
    first = layer.collect_step(source, 4, 0, 7)
    banked = {g.prompt_id for g in first.groups if normalised_variance([s.reward for s in g.samples]) >= 0.3}
    assert set(source.inner.bank) == banked
    assert len(banked) >= 2, "the scripted rewards give some groups variance"
    top = sorted(banked, key=lambda r: (-source.inner.bank[r][0], r))[:2]  # replay_fraction 0.5 of 4 groups
    layer.backend.push_weights(1)
    second = layer.collect_step(source, 4, 1, 7)
    assert [g.prompt_id for g in second.groups][:2] == top
    assert source.metrics()["sampling/vcrl_replay_frac"] == 0.5
    assert len({g.prompt_id for g in second.groups}) == len(second.groups)  # a prompt once a step


def test_refilling_sources_refuse_partial_rollouts():
    cfg = load_config(None, ["sampling.method=dars", "rollout.partial.enable=true"])
    with pytest.raises(ConfigError, match="rollout.partial.enable=true does not support"):
        make_group_source(SourceContext([0, 1], 8, 0, cfg))


def test_bad_sampling_values_name_their_key():
    for bad, key in [("sampling.vcrl_kappa=2", "vcrl_kappa"), ("sampling.dars_schedule=x", "dars_schedule")]:
        with pytest.raises(ConfigError, match=rf"sampling.{key}"):
            load_config(None, [bad])


def test_old_rollout_source_key_reads_as_sampling_method():
    assert load_config(None, ["rollout.source=dars"]).sampling.method == "dars"


# --- through the trainer ------------------------------------------------------------------------------------


@register_group_source("second_round_twice")
class SecondRoundTwice(GroupSource):
    """A user source that asks for one more round of the same rows: refill is called, groups are new."""

    refills = True

    def choose(self, k, version):
        self.calls = getattr(self, "calls", 0)
        return [0] * k

    def refill(self, scored, k, version):
        self.calls += 1
        return self.plan(k, version) if len(scored) < 2 * k else []


def test_a_user_source_refill_is_called_and_its_groups_trained(tmp_path):
    trainer = make_trainer(tiny_cfg(tmp_path, "sampling.method=second_round_twice", "trainer.steps=1"))
    batch, metrics = trainer.rollout(1)
    assert trainer.source.inner.calls == 2 and metrics["sampling/rounds"] == 2
    assert len(batch.completions) == 16  # two rounds of 2 groups x 4


@pytest.mark.parametrize(
    "extra",
    [
        ("sampling.method=dars", "sampling.dars_keep_degenerate=true"),
        ("sampling.method=vcrl", "sampling.dynamic=true", "sampling.vcrl_kappa=0.5"),
    ],
)
def test_sampling_sources_resume_exactly(tmp_path, extra):
    extra = (*extra, "trainer.save_every=1", "trainer.steps=3")
    straight = make_trainer(tiny_cfg(tmp_path, *extra, name="straight"))
    straight.train()
    killed = make_trainer(tiny_cfg(tmp_path, *extra, name="killed"))
    killed.train(until_step=2)
    state = killed.source.state_dict()
    killed.close()
    resumed = make_trainer(
        tiny_cfg(tmp_path, *extra, name="killed"), run_dir=tmp_path / "killed", resume=True
    )
    assert resumed.source.state_dict() == state
    resumed.train()
    assert straight.source.state_dict() == resumed.source.state_dict()
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = [r for r in rows(tmp_path / "straight") if "sampling/rounds" in r]
    assert len(logged) == 3 and all("sampling/zero_variance_frac" in r for r in logged)


def test_sampling_sees_plain_values_only():
    """The sources never touch the engine: a sampling object is not needed to plan."""
    assert Sampling().temperature == 1.0 and RolloutConfig().n == 8


def test_a_token_budget_ends_the_run_as_its_last_step_would(tmp_path):
    """2 groups x 4 samples of at most 12 tokens: at most 96 tokens a step, so 150 takes two steps or more."""
    trainer = make_trainer(tiny_cfg(tmp_path, "sampling.token_budget=150", "trainer.steps=10"))
    summary = trainer.train()
    logged = [r for r in rows(tmp_path / "run") if "sampling/generated_tokens_total" in r]
    totals = [r["sampling/generated_tokens_total"] for r in logged]
    per_step = [r["sampling/generated_tokens"] for r in logged]
    assert totals == [sum(per_step[: i + 1]) for i in range(len(per_step))]
    assert totals[-1] >= 150 > totals[-2] and trainer.state.step == len(totals) < 10
    assert summary and (tmp_path / "run" / "final").is_dir()  # ended as at trainer.steps


def test_dynamic_sampling_around_dars_extends_each_group_once():
    got, source, _ = step_once(
        "dars", "sampling.dynamic=true", "sampling.dars_keep_degenerate=true", k=4, rows_=8
    )
    extra = dars_extra_samples(Fraction(0), 4, 32, "et", std=True)
    assert all(len(g.samples) in (4, 4 + extra) for g in got.groups)  # never a second extension


def test_wrappers_share_one_count_of_occurrences_per_step():
    from sparserl.rollout import FreshPrompts, LeftoverBuffer

    cfg = load_config(None, [])
    inner = FreshPrompts(SourceContext([0, 1], 2, 0, cfg))
    outer = LeftoverBuffer(inner, cfg.rollout.partial)
    a, b = outer.new_group(1, 0), inner.new_group(1, 0)
    assert not set(a.keys) & set(b.keys)


def test_rounds_sum_their_times_and_workers_take_the_longest():
    from sparserl.rollout.backend import merge_run_metrics

    runs = [{"decode_s": 2.0, "peak_kv_bytes": 5.0, "decode_steps": 3, "kv_fill": 0.5},
            {"decode_s": 3.0, "peak_kv_bytes": 4.0, "decode_steps": 4, "kv_fill": 0.7}]  # fmt: skip
    rounds, workers = merge_run_metrics(runs, side_by_side=False), merge_run_metrics(runs, side_by_side=True)
    assert rounds["decode_s"] == 5.0 and workers["decode_s"] == 3.0
    assert rounds["peak_kv_bytes"] == workers["peak_kv_bytes"] == 5.0 and rounds["decode_steps"] == 7
    assert rounds["kv_fill"] == pytest.approx(0.6)


def test_settings_that_would_do_nothing_are_refused():
    with pytest.raises(ConfigError, match="algo.overlong_buffer=100 exceeds rollout.max_new_tokens=64"):
        load_config(None, ["algo.overlong_buffer=100", "rollout.max_new_tokens=64"])
    with pytest.raises(ConfigError, match="sampling.dars_n_max=8 leaves no extra samples"):
        check_group_sources(
            load_config(None, ["sampling.method=dars", "sampling.dars_n_max=8", "rollout.n=8"])
        )
    with pytest.raises(ConfigError, match=r"sampling.method=dars \(1 extra round\) and rollout.tree.enable=true "
                       r"\(1 extra round\) needs sampling.max_extra_rounds >= 2"):  # fmt: skip
        check_group_sources(
            load_config(
                None, ["sampling.method=dars", "rollout.tree.enable=true", "sampling.max_extra_rounds=1"]
            )
        )
    with pytest.raises(ConfigError, match="rollout.tree.enable=true starts samples from others"):
        check_group_sources(load_config(None, ["rollout.tree.enable=true", "trainer.log_acceptance=true"]))


def test_sources_read_capabilities_not_names():
    """DARS's schedule follows the estimator's declared std normalisation, and a registered wrapper joins the
    run's source by its own `enabled(cfg)` and `order`: no method is named outside its own class."""
    from sparserl.algo.advantages import ADV_ESTIMATORS, register_adv_estimator
    from sparserl.rollout import WRAPPERS, Dars, WrappedSource, register_wrapper

    @register_adv_estimator("test_std", std_normalised=True)
    def std_only(g, eps, unbiased):
        return g / (g.std(dim=1, keepdim=True) + eps)

    @register_wrapper("test_tag")
    class Tagged(WrappedSource):
        order, key = 15, "sampling.dynamic=true"  # between the tree (10) and dynamic sampling (20)

        @classmethod
        def enabled(cls, cfg):
            return cfg.sampling.dynamic

    try:
        cfg = load_config(
            None, ["sampling.method=dars", "algo.adv_estimator=test_std", "sampling.dynamic=true"]
        )
        ctx = SourceContext(list(range(8)), cfg.rollout.n, 0, cfg)
        assert Dars(ctx).std
        source, chain = make_group_source(ctx), []
        while hasattr(source, "inner"):
            source = source.inner
            chain.append(type(source).__name__)
        assert chain == ["DynamicSampling", "Tagged", "Dars"]
        assert not Dars(SourceContext([0], 4, 0, load_config(None, ["algo.adv_estimator=drgrpo"]))).std
    finally:
        del ADV_ESTIMATORS["test_std"], WRAPPERS["test_tag"]
