"""What the first run tells a new user: the KV memory saved against the dense engine's own allocation,
loss presets that keep the rollout method, the console's header and step line, the entropy estimate."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer import make_trainer, rows, tiny_cfg

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.allocation import dense_kv_allocation
from sparserl.engine.decoding import Request
from sparserl.models import encode_prompt, tiny_model
from sparserl.trainer.logging import kv_memory_text


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


def _prompts(tok) -> list[list[int]]:
    return [encode_prompt(tok, [{"role": "user", "content": "Count: " + "ab" * k}]) for k in (1, 6, 20)]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_dense_yardstick_is_the_dense_engines_own_peak(tiny, compile):
    """A group's prompt is held once: the dense engine's peak is its rows' own tokens plus each prompt once,
    exactly what `dense_kv_allocation` says (eager: shared prompts; compiled: copies in whole blocks)."""
    model, tok = tiny
    if compile:
        pytest.importorskip("torch._dynamo")
    engine = RolloutEngine(model, tok, compile=compile)
    engine.eos_ids = set()
    got = engine.generate(_prompts(tok), n=4, max_new_tokens=10, seed=1)
    assert got.stats["peak_dense_kv_bytes"] == got.stats["peak_kv_bytes"]
    naive = got.stats["kv_bytes_per_position"] * 12 * (max(map(len, _prompts(tok))) + 10)
    assert compile or got.stats["peak_kv_bytes"] < 0.5 * naive  # the old yardstick: rows x (prompt + max_new)


def test_block_topk_holds_at_least_the_dense_cache(tiny):
    model, tok = tiny
    kv = KVConfig(method="block_topk", budget=16, page_size=4, dense_layers=[0])
    engine = RolloutEngine(model, tok, kv)
    engine.eos_ids = set()
    got = engine.generate(_prompts(tok), n=4, max_new_tokens=10, seed=1)
    assert got.stats["peak_kv_bytes"] >= got.stats["peak_dense_kv_bytes"]


def test_dense_allocation_counts_resumed_samples_and_lone_prompts():
    """A request with completion tokens (resumed) and a lone prompt are copied whole; a group's prompt once."""
    group = [Request([1, 2, 3], k, 0, 5) for k in range(3)]
    lone = Request([7, 8], 9, 0, 5, prefix=[4])
    # rows: the group's own 5 each, the lone one 2 + 5 = 7: capacity 7, 4 rows, plus the prompt (3) once
    assert dense_kv_allocation([*group, lone], 10) == 10 * (4 * 7 + 3)
    assert dense_kv_allocation([*group, lone], 10, cap=100) == 100


def test_summary_says_when_no_kv_memory_is_saved():
    dense = {"kv_saved_fraction": 0.0, "peak_kv_bytes_mean": 2**20, "dense_kv_bytes_mean": 2**20}
    assert kv_memory_text(dense).startswith("no KV memory saved")
    more = {"kv_saved_fraction": 0.0, "peak_kv_bytes_mean": 2**21, "dense_kv_bytes_mean": 2**20}
    assert kv_memory_text(more).startswith("no KV memory saved")
    saved = {"kv_saved_fraction": 0.25, "peak_kv_bytes_mean": 3 * 2**20, "dense_kv_bytes_mean": 4 * 2**20}
    assert kv_memory_text(saved) == "25.0% (3.0 MiB vs 4.0 MiB for the dense engine, per rollout)"


def _step_row(run_dir: Path) -> dict:
    return [r for r in rows(run_dir) if "reward/mean" in r][0]


def test_a_dense_runs_yardstick_is_its_own_peak(tmp_path: Path):
    trainer = make_trainer(tiny_cfg(tmp_path, "algo.preset=dense", "trainer.steps=1"))
    summary = trainer.train()
    trainer.close()
    row = _step_row(tmp_path / "run")
    assert abs(row["kv/dense_kv_bytes"] / row["rollout/peak_kv_bytes"] - 1) < 0.01
    assert row["kv/naive_kv_bytes"] > row["kv/dense_kv_bytes"]
    assert kv_memory_text(summary).startswith("no KV memory saved")


def test_block_topk_run_reports_no_saving(tmp_path: Path):
    cfg = tiny_cfg(tmp_path, "kv.method=block_topk", "kv.page_size=4", "kv.budget=16", "trainer.steps=1")
    trainer = make_trainer(cfg)
    summary = trainer.train()
    trainer.close()
    row = _step_row(tmp_path / "run")
    assert row["rollout/peak_kv_bytes"] >= row["kv/dense_kv_bytes"]
    assert row["kv/saved_fraction"] == 0.0
    assert kv_memory_text(summary).startswith("no KV memory saved")


def test_entropy_estimate_is_the_mean_surprisal_of_the_sampled_tokens():
    import torch

    from sparserl.rollout.records import SampleRecord
    from sparserl.trainer.logging import sample_metrics

    a, b = SampleRecord(0, 0, 0, 0, 0), SampleRecord(0, 0, 1, 0, 1)
    a.tokens, a.sampler_logps, a.reward = [1, 2], [-1.0, -2.0], 1.0
    b.tokens, b.sampler_logps, b.reward = [3], [-3.0], 0.0
    assert sample_metrics([a, b], torch.zeros(2))["rollout/entropy_estimate"] == pytest.approx(2.0)


@pytest.mark.parametrize("loss", ["gspo", "dapo", "reinforce++", "reinforce++-baseline", "cispo"])
def test_a_loss_preset_keeps_the_runs_rollouts_and_corrections(loss):
    from sparserl.algo import PRESETS
    from sparserl.config import load_config

    default = load_config()
    cfg = load_config(None, [f"algo.preset={loss}"])
    assert cfg.sparse and cfg.kv.method == default.kv.method and cfg.algo.preset == f"sparse-rl+{loss}"
    for key in ("correction_mode", "veto_threshold", "token_rs_low", "token_rs_high", "tis_cap"):
        assert getattr(cfg.algo, key) == getattr(default.algo, key), key
    for key, value in PRESETS[loss].items():
        assert getattr(cfg.algo, key) == value, key
    dense = load_config("dense", [f"algo.preset={loss}"])  # a dense config stays dense
    assert not dense.sparse and dense.algo.preset == f"dense+{loss}"


def test_cispo_is_a_preset_and_presets_combine():
    from sparserl.config import ConfigError, load_config

    assert load_config(None, ["algo.preset=cispo"]).algo.policy_loss == "cispo"
    cfg = load_config(None, ["algo.preset=tis+reinforce++"])
    assert cfg.algo.tis_cap == 2.0 and cfg.algo.adv_estimator == "reinforce"
    assert load_config(None, ["algo.preset=tis+gspo", "algo.preset=dense"]).algo.preset == "dense+gspo"
    with pytest.raises(ConfigError, match="'clip' is unknown.*loss presets: gspo.*algo.policy_loss=NAME"):
        load_config(None, ["algo.preset=clip"])
    with pytest.raises(ConfigError, match="two presets of one kind"):
        load_config(None, ["algo.preset=gspo+cispo"])


def test_loss_presets_set_no_rollout_or_correction_key():
    from sparserl.algo import PRESETS
    from sparserl.algo.config import CORRECTION_KNOBS
    from sparserl.algo.presets import LOSS_PRESETS

    for name in LOSS_PRESETS:
        assert not {"sparse_rollout", "correction_mode", *CORRECTION_KNOBS} & set(PRESETS[name]), name


def test_header_names_every_active_system_and_the_kv_schedule():
    from sparserl.config import load_config
    from sparserl.trainer.console import header

    plain = header(load_config(), "runs/x")
    assert "rollouts sparse rkv, budget 80" in plain and "systems on" not in plain
    on = [
        "sampling.method=dars", "sampling.dynamic=true", "shaping.method=uniqueness", "rollout.spec.enable=true",
        "rollout.tree.enable=true", "distributed.rollout_workers=2", "distributed.learners=2",
    ]  # fmt: skip
    text = header(load_config(None, on), "runs/x")
    for words in ("sampling dars", "dynamic sampling", "shaping uniqueness", "SPEC-RL", "tree rollouts",
                  "2 Ray rollout workers", "2 learners"):  # fmt: skip
        assert words in text, words
    sched = load_config(None, ["kv.method=block_topk", "kv.schedule=[[0,64],[48,128]]", "kv.budget=80"])
    assert "block_topk, schedule of 2 bins (budgets 64-128)" in header(sched, "runs/x")
    assert "budget 80" not in header(sched, "runs/x")


def test_header_summary_and_run_dir_name_a_quantized_cache(tmp_path: Path):
    """kv.quant changes what the sampler reads, so the header, the run summary's `rollouts` and the run
    directory's name say it; a quantized dense cache shows no budget (it has none)."""
    from sparserl.config import load_config
    from sparserl.trainer.console import header, kv_text
    from sparserl.trainer.run_dir import new_run_dir

    cases = [
        (["kv.quant=int8"], "rollouts sparse rkv, budget 80, int8 KV", "-rkv-int8-"),
        (["kv.quant=fp8", "kv.method=dense"], "rollouts dense, fp8 KV", "-dense-fp8-"),
        (["kv.quant=int8", "algo.preset=dense"], "rollouts dense,", "-dense-2"),
    ]
    for overrides, words, name in cases:
        cfg = load_config(None, [*overrides, f"trainer.output_dir={tmp_path}"])
        assert words in header(cfg, "runs/x"), (overrides, header(cfg, "runs/x"))
        assert name in new_run_dir(cfg).name, (overrides, new_run_dir(cfg).name)
    assert kv_text(load_config(None, ["kv.quant=fp8", "kv.method=dense"])) == "dense, fp8 KV"


def test_notes_say_spec_rl_is_idle_at_first_and_eval_runs_at_its_own_temperature():
    from sparserl.config import load_config
    from sparserl.trainer.console import notes

    said = " ".join(notes(load_config(None, ["rollout.spec.enable=true"])))
    assert "SPEC-RL reuses a prompt's previous samples only when that prompt comes back" in said
    assert "temperature 0.5 (trainer.eval_temperature), training at 1" in said
    assert notes(load_config(None, ["trainer.eval_temperature=1.0"])) == []


def test_step_line_shows_each_systems_number():
    from sparserl.config import load_config
    from sparserl.trainer.console import step_numbers

    cfg = load_config(None, ["sampling.dynamic=true", "rollout.spec.enable=true", "rollout.tree.enable=true"])
    m = {
        "rollout/entropy_estimate": 1.234, "sampling/generated_samples": 40.0, "sampling/tree_leaves": 20.0,
        "sampling/spec_reused_tokens": 300.0, "sampling/generated_tokens": 100.0,
    }  # fmt: skip
    assert step_numbers(cfg, m) == "H 1.23  +8 samples  leaves 20  reused 75%"
    assert step_numbers(load_config(), {"rollout/entropy_estimate": 0.5}) == "H 0.50"


def test_progress_says_the_phase_before_the_first_step():
    from io import StringIO

    from rich.console import Console

    from sparserl.trainer.logging import ProgressDisplay

    out = StringIO()
    bar = ProgressDisplay(8, 0, console=Console(file=out, force_terminal=False), numbers=lambda m: "H 1.00")
    bar.phase("evaluating before training")
    bar.phase("step 1: sampling")
    bar.update(1, {"reward/mean": 0.5})
    bar.phase("step 2: sampling")
    bar.phase("evaluating after training", after_steps=True)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["evaluating before training...", "step 1: sampling..."]
    assert lines[2].startswith("step 1/8  reward 0.500") and lines[2].endswith("H 1.00")
    assert lines[3:] == ["evaluating after training..."]


def test_eval_sample_shown_is_the_median_length_prompt():
    from types import SimpleNamespace

    from sparserl.tasks import Example
    from sparserl.trainer.evaluation import HeldOutEval

    lengths = {10: 3, 11: 9, 12: 5, 13: 7, 14: 1}  # row -> prompt length; median: row 12
    view = SimpleNamespace(prompt_ids=lambda row: [0] * lengths[row])
    cfg = SimpleNamespace(logging=SimpleNamespace(print_samples=1))
    held = HeldOutEval(cfg, view, list(lengths), {}, None)
    held.samples = [
        (f"text {row}", Example([{"role": "user", "content": f"q{row}"}], "a"), 0.0) for row in lengths
    ]
    said = []
    held.print_samples(SimpleNamespace(print=lambda text, **_: said.append(text)), "before training")
    assert len(said) == 1 and "q12" in said[0]
