"""TrainConfig: YAML + overrides, presets, typed coercion and the errors a user sees."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparserl.algo import PRESETS
from sparserl.config import (
    CONFIG_DIR,
    ConfigError,
    TrainConfig,
    coerce,
    config_from_dict,
    format_help,
    iter_fields,
    list_run_presets,
    load_config,
    save_config,
)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_every_field_has_help() -> None:
    missing = [path for path, _, help_text in iter_fields() if not help_text.strip()]
    assert not missing, f"fields without a help string: {missing}"
    text = format_help()
    for path, _, _ in iter_fields():
        assert path in text


def test_embedded_default() -> None:
    cfg = load_config()
    assert cfg == TrainConfig()
    assert cfg.model.spec == "smollm2-135m" and cfg.task.name == "arithmetic"
    assert cfg.algo.preset == "sparse-rl" and cfg.kv.method == "rkv" and cfg.sparse
    for key, value in PRESETS["sparse-rl"].items():
        assert getattr(cfg.algo, key) == value
    assert load_config("default") == cfg  # configs/default.yaml spells out the same run


def test_run_presets_all_load() -> None:
    names = list_run_presets()
    assert "default" in names and len(names) >= 3
    for name in names:
        cfg = load_config(CONFIG_DIR / f"{name}.yaml")
        assert cfg.algo.preset in PRESETS


def test_yaml_then_overrides_with_types(tmp_path: Path) -> None:
    p = write(tmp_path, "optim:\n  lr: 1e-5\nrollout:\n  n: 4\nmodel:\n  lora: true\n")
    cfg = load_config(
        p, ["optim.lr=3e-4", "trainer.steps=7", "model.lora_targets=q_proj,v_proj", "kv.budget=256"]
    )
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)  # command line wins over the file
    assert cfg.trainer.steps == 7 and cfg.rollout.n == 4
    assert cfg.model.lora is True and cfg.model.lora_targets == ["q_proj", "v_proj"]
    assert cfg.kv.budget == 256 and cfg.kv.method == "rkv"  # the section keeps its other defaults
    assert load_config(p).optim.lr == 1e-5  # YAML 1.1 reads '1e-5' as a string; the float field coerces it


def test_preset_applies_first_then_keys(tmp_path: Path) -> None:
    cfg = load_config(None, ["algo.preset=dense", "algo.eps_high=0.28"])
    assert cfg.algo.correction_mode == "none" and cfg.algo.eps_high == 0.28 and not cfg.sparse
    p = write(tmp_path, "algo:\n  kl_coef: 0.0\n  preset: tis\n")
    cfg = load_config(p)
    assert cfg.algo.tis_cap == PRESETS["tis"]["tis_cap"] and cfg.algo.kl_coef == 0.0
    # the key order in YAML does not matter: the preset is always applied before the other keys
    cfg = load_config(p, ["algo.preset=sparse-rl"])
    assert cfg.algo.veto_threshold == 1e-4 and cfg.algo.kl_coef == 0.0


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        None, ["algo.preset=geo-rs", "optim.betas=[0.8, 0.9]", "trainer.run_name=x", "rollout.stop=a,b"]
    )
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_unknown_key_lists_valid_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.stpes=3"])
    msg = str(e.value)
    assert "trainer.stpes" in msg and "did you mean 'steps'" in msg
    for key in ("steps", "seed", "save_every", "keep_last"):
        assert key in msg
    p = write(tmp_path, "model:\n  spec: x\noptim:\n  lr: 1e-5\n  learning_rate: 1\n")
    with pytest.raises(
        ConfigError,
        match=r"run\.yaml:5: unknown config key 'optim\.learning_rate'.*valid keys under 'optim': lr, betas",
    ):
        load_config(p)
    with pytest.raises(
        ConfigError, match="valid keys at the top level: model, task, rollout, sampling, kv, algo"
    ):
        load_config(write(tmp_path, "optimizer:\n  lr: 1\n"))


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("optim.lr=fast", "optim.lr='fast' is not a valid float"),
        ("trainer.steps=2.5", "trainer.steps='2.5' is not a valid int"),
        ("model.lora=maybe", "model.lora='maybe' is not a valid bool"),
        ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers"),
        ("rollout.temperature=0", "rollout.temperature=0.0 must be a finite number > 0"),
        ("kv.method=lru", "kv.method='lru' is unknown"),
        ("task.operators=/", "task.operators='/'"),
        ("trainer", "must look like section.key=value"),
        ("trainer.steps.x=1", "'trainer.steps' is not a section: it takes one int value"),
    ],
)
def test_bad_values_name_the_key(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert fragment in str(e.value)


def test_bad_type_in_yaml_names_file_and_line(tmp_path: Path) -> None:
    p = write(tmp_path, "trainer:\n  seed: 1\n  steps: many\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: trainer\.steps='many' is not a valid int"):
        load_config(p)
    with pytest.raises(ConfigError, match="'trainer' must be a mapping"):
        load_config(write(tmp_path, "trainer: 5\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "trainer: [\n"))


def test_unknown_presets() -> None:
    with pytest.raises(
        ConfigError,
        match="algo.preset='sprase-rl': 'sprase-rl' is unknown. Rollout presets.*dense, naive-sparse",
    ):
        load_config(None, ["algo.preset=sprase-rl"])
    with pytest.raises(ConfigError, match="neither a file nor a run preset.*presets: .*default"):
        load_config("no-such-preset")


def test_cross_section_checks() -> None:
    with pytest.raises(
        ConfigError, match=r"algo.group_size is gone: advantages are taken over each sample's group"
    ):
        load_config(None, ["algo.group_size=3"])
    assert load_config(None, ["algo.group_size=8"]).rollout.n == 8  # configs saved before: read, then dropped
    with pytest.raises(ConfigError, match="rloo needs rollout.n >= 2"):
        load_config(None, ["algo.adv_estimator=rloo", "rollout.n=1"])
    with pytest.raises(ConfigError, match="must divide the rollout batch"):
        load_config(None, ["optim.mini_batch_size=5"])
    with pytest.raises(ConfigError, match="samples sparse rollouts but kv.method='dense'"):
        load_config(None, ["kv.method=dense"])
    assert not load_config(None, ["kv.method=dense", "algo.preset=dense"]).sparse
    with pytest.raises(ConfigError, match="kv.budget=8 must exceed"):
        load_config(None, ["kv.budget=8"])


def test_optional_and_null() -> None:
    cfg = load_config(None, ["algo.tis_cap=null", "trainer.run_name=none"])
    assert cfg.algo.tis_cap is None and cfg.trainer.run_name is None
    assert config_from_dict({"algo": {"tis_cap": None}}).algo.tis_cap is None


@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_int_coercion_round_trips(n: int) -> None:
    assert coerce(str(n), int, "k") == n
    assert coerce(n, float, "k") == float(n)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_float_coercion_round_trips(x: float) -> None:
    assert coerce(repr(x), float, "k") == x
    with pytest.raises(ConfigError):
        coerce(True, float, "k")
