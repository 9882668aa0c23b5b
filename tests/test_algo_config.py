"""AlgoConfig, PRESETS and algo_config: defaults, the reference values, clear errors."""

from __future__ import annotations

from dataclasses import fields

import pytest

from sparserl.algo import PRESETS, AlgoConfig, algo_config


def test_every_field_has_help():
    for f in fields(AlgoConfig):
        assert f.metadata.get("help"), f"AlgoConfig.{f.name} has no help string"


def test_defaults_are_dense_grpo():
    cfg = AlgoConfig()
    assert cfg == algo_config("dense")
    assert not cfg.sparse_rollout
    assert cfg.correction_mode == "none"
    assert cfg.adv_estimator == "grpo" and cfg.adv_eps == 1e-6 and cfg.adv_std_unbiased
    assert cfg.loss_agg_mode == "seq-mean-token-mean" and cfg.rejected_in_denominator
    assert cfg.needs_recompute


def test_required_presets_exist_and_build():
    assert {"dense", "naive-sparse", "sparse-rl", "tis", "icepop", "geo-rs"} <= set(PRESETS)
    for name, overrides in PRESETS.items():
        assert isinstance(overrides, dict)
        cfg = algo_config(name)
        for k, v in overrides.items():
            assert getattr(cfg, k) == v, (name, k)


def test_sparse_rl_preset_is_the_reference():
    cfg = algo_config("sparse-rl")
    assert cfg.sparse_rollout and cfg.correction_mode == "decoupled"
    assert cfg.veto_threshold == 1e-4
    assert (cfg.token_rs_low, cfg.token_rs_high) == (0.5, 1.5)
    assert cfg.tis_cap == 1.5 and cfg.tis_batch_norm
    assert cfg.eps_low == cfg.eps_high == 0.2
    assert cfg.kl_coef == 1e-4 and cfg.kl_estimator == "k3"
    assert cfg.entropy_coef == 0.0


def test_naive_sparse_samples_sparse_without_correction():
    cfg = algo_config("naive-sparse")
    assert cfg.sparse_rollout and cfg.correction_mode == "none"


def test_overrides_apply_key_by_key_and_presets_stay_untouched():
    before = dict(PRESETS["sparse-rl"])
    cfg = algo_config("sparse-rl", tis_cap=2.0, eps_high=0.28)
    assert cfg.tis_cap == 2.0 and cfg.eps_high == 0.28 and cfg.veto_threshold == 1e-4
    assert PRESETS["sparse-rl"] == before


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="'sparse' is unknown.*sparse-rl.*algo.policy_loss"):
        algo_config("sparse")


def test_unknown_key_lists_valid_ones():
    with pytest.raises(ValueError, match="tis_capp.*valid keys:.*tis_cap"):
        algo_config("dense", tis_capp=1.0)


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        ({"adv_estimator": "ppo"}, "adv_estimator"),
        ({"correction_mode": "on"}, "correction_mode"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"correction_mode": "decoupled", "token_rs_low": 2.0, "token_rs_high": 1.0}, "token_rs_low"),
        ({"correction_mode": "decoupled", "tis_cap": 0.0}, "tis_cap"),
        ({"correction_mode": "decoupled", "veto_threshold": 0.0}, "veto_threshold"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"adv_transforms": ["no_such"]}, "adv_transforms='no_such' is unknown"),
        ({"tis_cap": 2.0}, "correction_mode='none' ignores algo.tis_cap"),
    ],
)
def test_bad_values_name_the_key(kwargs, culprit):
    with pytest.raises(ValueError, match=culprit):
        AlgoConfig(**kwargs)


def test_bypass_skips_recompute():
    assert not algo_config("tis", correction_mode="bypass").needs_recompute
