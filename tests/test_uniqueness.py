"""Uniqueness-aware advantages (docs/uniqueness.md): the weights, both modes, the judges, metrics, config."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import sparserl.trainer.judges  # noqa: F401  registers the model-backed judges
from sparserl.algo import AlgoConfig, advantages
from sparserl.algo.advantages import BatchWhiten, TransformContext, make_adv_transforms
from sparserl.algo.uniqueness import (
    JUDGES,
    Judge,
    Uniqueness,
    agglomerative_labels,
    arithmetic_skeleton,
    make_judge,
    uniqueness_weights,
)
from sparserl.config.errors import ConfigError
from sparserl.config.shaping import ShapingConfig
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.errors import UserError
from sparserl.models import tiny_model
from sparserl.trainer.judges import LLMJudge, parse_labels

MAJORITY = [  # add, then double: the same procedure in four wordings and number sets
    "First add: 12 + 7 = 19. Then double it: 19 * 2 = 38. \\boxed{38}",
    "We have 3 + 4 = 7 apples, and twice that is 7 * 2 = 14.\nThe answer is \\boxed{14}.",
    "12+7=19\n19*2=38\n\\boxed{38}",
    "Adding gives 10 + 5 = 15; doubling, 15 \\times 2 = 30. So \\boxed{30}",
]
SINGLETON = "Double each: 12 * 2 = 24 and 7 * 2 = 14, so 24 + 14 = 38. \\boxed{38}"
WRONG = ["I think it is \\boxed{40}", "12 - 7 = 5 \\boxed{5}", "no idea"]
GROUP = [*MAJORITY, SINGLETON, *WRONG]
REWARDS = torch.tensor([1.0] * 5 + [0.0] * 3)


def transform(algo: AlgoConfig | None = None, policy=None, **shaping) -> Uniqueness:
    """The uniqueness transform with `shaping` options over the defaults (rule judge, alpha=1)."""
    options = {"method": "uniqueness", "alpha": 1.0} | shaping
    return Uniqueness(TransformContext(algo or AlgoConfig(), ShapingConfig(**options), policy))


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_model(seed=0)
    return SimpleNamespace(
        module=model, tokenizer=tok, engine=RolloutEngine(model, tok), autocast=contextlib.nullcontext
    )


# ---- the transform --------------------------------------------------------------------------------------------


def test_acceptance_singleton_strategy_weighs_four_times_the_majority():
    adv = advantages(REWARDS, [0] * 8)
    assert adv[0] == adv[4]  # both correct kinds share one unweighted advantage
    out = transform()(adv, REWARDS, torch.zeros(8, dtype=torch.long), GROUP)
    assert out[4] == 4 * out[0]
    assert torch.equal(out[:4], adv[:4] * 0.25)
    assert torch.equal(out[5:], adv[5:])  # wrong rollouts unchanged
    assert out.dtype == adv.dtype


@pytest.mark.parametrize("mode", ["advantage", "reward"])
def test_alpha_zero_is_bit_exact(mode):
    algo = AlgoConfig(adv_transforms=["batch_whiten"])
    index = torch.tensor([0] * 8 + [1] * 8)
    rewards = torch.cat([REWARDS, REWARDS.flip(0)])
    adv = BatchWhiten(TransformContext(algo))(advantages(rewards, index), rewards, index, GROUP * 2)
    out = transform(algo, alpha=0.0, mode=mode)(adv, rewards, index, GROUP * 2)
    assert torch.equal(out, adv)


def test_reward_mode_recomputes_with_the_estimator():
    algo = AlgoConfig(adv_estimator="drgrpo")
    adv = advantages(REWARDS, [0] * 8, "drgrpo")
    out = transform(algo, mode="reward")(adv, REWARDS, torch.zeros(8, dtype=torch.long), GROUP)
    shaped = torch.tensor([0.25] * 4 + [1.0] + [0.0] * 3, dtype=torch.float64)
    torch.testing.assert_close(out, (shaped - shaped.mean()).float())
    assert out.dtype == adv.dtype


def test_reward_mode_reruns_algo_transforms_on_shaped_rewards():
    algo = AlgoConfig(adv_transforms=["batch_whiten"])
    ctx = TransformContext(algo)
    index = torch.zeros(8, dtype=torch.long)
    adv = BatchWhiten(ctx)(advantages(REWARDS, index), REWARDS, index, GROUP)
    out = transform(algo, mode="reward", alpha=0.5)(adv, REWARDS, index, GROUP)
    shaped = REWARDS.double() * torch.tensor([0.5] * 4 + [1.0] * 4, dtype=torch.float64)
    expect = BatchWhiten(ctx)(advantages(shaped, index), shaped, index, GROUP)
    torch.testing.assert_close(out, expect.float())


def test_token_level_rows_are_scaled():
    adv = advantages(REWARDS, [0] * 8)
    mask = torch.ones(8, 5)
    mask[:, 3:] = 0  # padding
    adv2d = adv[:, None] * mask
    out = transform()(adv2d, REWARDS, torch.zeros(8, dtype=torch.long), GROUP)
    w = torch.tensor([0.25] * 4 + [1.0] * 4)
    assert torch.equal(out, adv2d * w[:, None])


def test_reward_mode_refuses_token_level_input_it_cannot_rebuild():
    adv = advantages(REWARDS, [0] * 8)[:, None].expand(8, 3)
    with pytest.raises(ValueError, match="token-level"):
        transform(mode="reward")(adv, REWARDS, torch.zeros(8, dtype=torch.long), GROUP)


def test_texts_are_required():
    adv = advantages(REWARDS, [0] * 8)
    with pytest.raises(ValueError, match="one completion text"):
        transform()(adv, REWARDS, torch.zeros(8, dtype=torch.long), [])


def test_metrics_on_a_hand_made_batch():
    # group 0: clusters {4, 1}; group 1: all wrong; group 2: two correct, two strategies; group 3: one correct
    texts = GROUP + WRONG + ["1 + 2 = 3 \\boxed{3}", "1 * 3 = 3 \\boxed{3}", "2 - 1 = 1 \\boxed{1}"]
    rewards = torch.cat([REWARDS, torch.zeros(3), torch.tensor([1.0, 1.0, 1.0])])
    index = torch.tensor([0] * 8 + [1] * 3 + [2, 2, 3])
    t = transform()
    assert t.metrics() == {
        "clusters_per_group": 0.0,
        "adv_scale_min": 1.0,
        "adv_scale_max": 1.0,
        "judge_failures": 0.0,
    }
    t(advantages(rewards, index), rewards, index, texts)
    assert t.metrics() == {
        "clusters_per_group": (2 + 2 + 1) / 3,
        "adv_scale_min": 0.25,
        "adv_scale_max": 1.0,
        "judge_failures": 0.0,
    }


def test_the_chain_builder_appends_the_shaping_method():
    shaping = ShapingConfig(method="uniqueness")
    chain = make_adv_transforms(AlgoConfig(adv_transforms=["batch_whiten"]), shaping)
    assert [type(t) for t in chain] == [BatchWhiten, Uniqueness]


# ---- pure parts ------------------------------------------------------------------------------------------------


def test_weights_count_clusters_within_each_group():
    w = uniqueness_weights([0, 0, 1, None, 0, 0], [0, 0, 0, 0, 1, 1], alpha=1.0)
    assert w.tolist() == [0.5, 0.5, 1.0, 1.0, 0.5, 0.5]  # label 0 of group 1 is not group 0's
    assert uniqueness_weights([0, 0, None], [0, 0, 0], alpha=0.0).tolist() == [1.0, 1.0, 1.0]


def test_average_linkage_merges_up_to_the_threshold():
    d = torch.tensor(
        [[0.0, 0.125, 0.5, 1.0], [0.125, 0.0, 0.75, 1.0], [0.5, 0.75, 0.0, 0.875], [1.0, 1.0, 0.875, 0.0]]
    )  # dyadic: the linkages are exact
    assert agglomerative_labels(d, 0.0625) == [0, 1, 2, 3]
    assert agglomerative_labels(d, 0.125) == [0, 0, 1, 2]  # the bound is inclusive
    assert agglomerative_labels(d, 0.6) == [0, 0, 1, 2]  # {0,1} to 2: mean(0.5, 0.75) = 0.625
    assert agglomerative_labels(d, 0.625) == [0, 0, 0, 1]
    assert agglomerative_labels(d, 0.95) == [0, 0, 0, 1]  # {0,1,2} to 3: mean(1, 1, 0.875) = 0.9583
    assert agglomerative_labels(d, 0.96) == [0, 0, 0, 0]


@pytest.mark.parametrize("name", ["embedding", "llm"])
def test_a_model_backed_judge_built_without_the_policy_names_itself(name):
    with pytest.raises(ValueError, match=rf"shaping.judge='{name}' needs the policy model"):
        make_judge(name, TransformContext(AlgoConfig()))


# ---- the rule judge ---------------------------------------------------------------------------------------------


def test_rule_judge_ignores_numbers_and_wording_not_procedure():
    judge = make_judge("rule", TransformContext(AlgoConfig()))
    assert judge.cluster(GROUP[:5]) == [0, 0, 0, 0, 1]
    add_then_double = "Add them: 3 + 4 = 7. Then 7 * 5 = 35. \\boxed{35}"
    reworded = (
        "There are 10 cats and 2 dogs, so 10 + 2 = 12 animals; multiplying, 12 * 3 = 36 gives \\boxed{36}"
    )
    distribute = "Multiply first: 3 * 5 = 15, then 4 * 5 = 20, total 15 + 20 = 35. \\boxed{35}"
    grouped = "(3 + 4) \\times 5 = 35, \\boxed{35}"
    assert judge.cluster([add_then_double, reworded, distribute, grouped]) == [0, 0, 1, 2]


def test_arithmetic_skeleton_examples():
    assert arithmetic_skeleton("12 + 7 = 19, then 19 * 2 = 38: \\boxed{38}") == "N+N=N;N*N=N|N"
    assert arithmetic_skeleton("1,200 \u00f7 4 = 300 and 300 x 2 = 600") == "N/N=N;N*N=N|"
    assert arithmetic_skeleton("A 5-year-old has 3 toys.\n1. Step") == "|"  # no computation
    assert arithmetic_skeleton("\\boxed{\\frac{3}{4}}").endswith("|(N)/(N)")


# ---- the model-backed judges --------------------------------------------------------------------------------------


def test_embedding_judge_on_a_tiny_model(tiny):
    texts = ["12 + 7 = 19", "a completely different text", "12 + 7 = 19", "x"]

    def judge(threshold: float) -> Judge:
        return make_judge(
            "embedding", TransformContext(AlgoConfig(), ShapingConfig(judge_threshold=threshold), tiny)
        )

    assert judge(0.0).cluster(texts) == [0, 1, 0, 2]
    assert judge(2.0).cluster(texts) == [0, 0, 0, 0]
    alone, batched = judge(0.1).embed(["x"]), judge(0.1).embed(["x", "a much longer text than x"])
    # right padding does not reach a text's own tokens (float32 forwards: to rounding)
    torch.testing.assert_close(alone[0], batched[0], rtol=1e-4, atol=1e-5)


def test_llm_judge_on_a_tiny_model_falls_back_to_singletons(tiny):
    judge = make_judge("llm", TransformContext(AlgoConfig(), ShapingConfig(judge_max_new_tokens=8), tiny))
    texts = ["1 + 1 = 2", "2 * 1 = 2", "1 + 1 = 2"]
    assert judge.cluster(texts) == [0, 1, 2]  # a random model's answer does not parse
    assert judge.failures == 1
    assert judge.cluster(texts) == [0, 1, 2] and judge.failures == 1  # cached: no second call


class FakeEngine:
    """Answers every prompt with the same text, counting calls and keeping the keywords of the last one."""

    def __init__(self, tokenizer, answer: str) -> None:
        self.ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        self.calls, self.kwargs = 0, {}

    def generate(self, prompts, **kwargs):
        self.calls += 1
        self.kwargs = kwargs
        return [SimpleNamespace(completion_ids=self.ids)]


def test_llm_judge_parses_a_well_formed_answer(tiny):
    engine = FakeEngine(tiny.tokenizer, 'Labels: ["add", "add", "mul"] done')
    policy = SimpleNamespace(module=tiny.module, tokenizer=tiny.tokenizer, engine=engine)
    judge = make_judge("llm", TransformContext(AlgoConfig(), ShapingConfig(judge_max_new_tokens=16), policy))
    assert judge.cluster(["a", "b", "c"]) == [0, 0, 1]
    assert judge.cluster(["a", "b", "c"]) == [0, 0, 1] and engine.calls == 1
    assert engine.kwargs["temperature"] == 0.0 and engine.kwargs["max_new_tokens"] == 16
    assert judge.failures == 0


def test_llm_judge_samples_on_a_dense_cache(tiny):
    policy = SimpleNamespace(**vars(tiny))
    policy.engine = RolloutEngine(tiny.module, tiny.tokenizer, KVConfig(method="rkv", budget=32))
    judge = LLMJudge(TransformContext(AlgoConfig(), ShapingConfig(), policy))
    assert not judge.engine().kv.sparse
    assert LLMJudge(TransformContext(AlgoConfig(), ShapingConfig(), tiny)).engine() is tiny.engine


@pytest.mark.parametrize(
    ("answer", "labels"),
    [("[2, 2, 5]", [0, 0, 1]), ("x [0,1,0] y [1,1,1]", [0, 1, 0]), ("[0, 1]", None), ("[true, 1, 1]", None),
     ("[0, 1, 2", None), ("[0, 'a', 1]", None), ("no list", None), ("[[0], [1], [2]]", None)],
)  # fmt: skip
def test_parse_labels(answer, labels):
    assert parse_labels(answer, 3) == labels


def test_llm_failures_reach_the_metrics(tiny):
    engine = FakeEngine(tiny.tokenizer, "I cannot tell")
    policy = SimpleNamespace(module=tiny.module, tokenizer=tiny.tokenizer, engine=engine)
    t = transform(policy=policy, judge="llm")
    adv = advantages(REWARDS, [0] * 8)
    out = t(adv, REWARDS, torch.zeros(8, dtype=torch.long), GROUP)
    assert torch.equal(out, adv)  # all singletons: no reweighting
    assert t.metrics()["judge_failures"] == 1.0 and t.metrics()["clusters_per_group"] == 5.0


def test_model_judge_not_registered_is_a_clear_error(monkeypatch):
    monkeypatch.delitem(JUDGES, "embedding")
    with pytest.raises(UserError, match="sparserl.trainer.judges"):
        make_judge("embedding", TransformContext(AlgoConfig(), ShapingConfig()))


def test_a_registered_judge_is_used(monkeypatch):
    class Alike(Judge):
        def cluster(self, texts):
            return [7] * len(texts)

    monkeypatch.setitem(JUDGES, "everything_alike", Alike)  # what @register_judge("everything_alike") does
    out = transform(judge="everything_alike")(advantages(REWARDS, [0] * 8), REWARDS, torch.zeros(8), GROUP)
    assert out[4] == out[0]  # five correct in one cluster: one weight


# ---- config ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "key"),
    [({"alpha": -1.0}, "shaping.alpha"), ({"alpha": float("inf")}, "shaping.alpha"),
     ({"mode": "both"}, "shaping.mode"), ({"judge": "oracle"}, "shaping.judge"),
     ({"method": "rarity"}, "shaping.method"), ({"judge_threshold": -0.1}, "shaping.judge_threshold"),
     ({"judge_max_new_tokens": 0}, "shaping.judge_max_new_tokens")],
)  # fmt: skip
def test_bad_config_values_name_their_key(options, key):
    with pytest.raises(ConfigError, match=key):
        ShapingConfig(**options)


def test_every_config_field_has_help():
    from dataclasses import fields

    assert all(f.metadata.get("help") for f in fields(ShapingConfig))
    assert ShapingConfig().method == "none"


@pytest.mark.parametrize("judge", ["rule", "embedding", "llm"])
def test_uniqueness_runs_through_the_trainer(tmp_path, judge):
    from tests.test_trainer import make_trainer, rows, tiny_cfg

    extra = ("shaping.method=uniqueness", f"shaping.judge={judge}", "shaping.judge_max_new_tokens=8")
    trainer = make_trainer(tiny_cfg(tmp_path, *extra, "trainer.steps=1"))
    trainer.train()
    (row,) = [r for r in rows(tmp_path / "run") if "reward/mean" in r]
    assert {"shaping/clusters_per_group", "shaping/adv_scale_min", "shaping/adv_scale_max"} <= row.keys()
    assert 0 < row["shaping/adv_scale_min"] <= row["shaping/adv_scale_max"] <= 1
