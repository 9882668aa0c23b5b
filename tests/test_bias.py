"""`sparserl bias`: the statistics on vectors with a known answer, the coupled twins on the tiny model, an injected
sampler perturbation seen in the expected direction, the CountSketch against exact cosines, the CLI and --resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparserl.cli import main
from sparserl.config import load_config
from sparserl.errors import UserError
from sparserl.eval.bias import per_token_gaps
from sparserl.eval.bias_command import BiasSettings, measure
from sparserl.eval.bias_run import BiasRun, Sketch
from sparserl.eval.bias_stats import (
    CORRECTIONS_MATTER,
    INCONCLUSIVE,
    INERT,
    bootstrap_counts,
    gradient_report,
    pair_means,
    ratio_of_sums,
    verdict,
)
from sparserl.tasks import Example, Task


class VowelTask(Task):
    """A reward with a consistent gradient on a random tiny model: the share of vowels in the completion."""

    name = "vowels"

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> Example:
        return Example(messages=[{"role": "user", "content": f"Say something about {i}."}], answer="")

    def reward(self, completion_text: str, example: Example) -> float:
        return sum(ch in "aeiouAEIOU" for ch in completion_text) / max(1, len(completion_text))


def tiny(*extra: str):
    return load_config(
        None,
        ["model.spec=tiny-llama", "model.lora=false", "rollout.prompts_per_step=2", "rollout.n=8",
         "rollout.max_new_tokens=10", "kv.method=rkv", "kv.budget=16", "kv.interval=4", "kv.window=2", *extra],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- statistics


def test_pair_means_are_unbiased_where_the_mean_of_squared_norms_is_not():
    """E<g_k, g_l> over distinct batches is ||mu||^2; the mean of ||g_k||^2 adds the noise variance."""
    gen = torch.Generator().manual_seed(0)
    mu = torch.tensor([1.0, 2.0, 0.0, 0.0])
    g = mu + 3.0 * torch.randn(4000, 4, generator=gen, dtype=torch.float64)
    block = g @ g.T
    ones = torch.ones(1, 4000, dtype=torch.float64)
    assert float(pair_means(block, ones)[0]) == pytest.approx(5.0, abs=0.5)
    assert float(block.diagonal().mean()) == pytest.approx(5.0 + 4 * 9.0, rel=0.05)  # the biased one


def test_gradient_report_intervals_cover_the_known_values():
    """Vectors with known expectations: the point estimates land near the truth and the 90% intervals cover it."""
    gen = torch.Generator().manual_seed(1)
    dense, naive, fixed = (
        torch.tensor([1.0, 0.0, 0.0]),
        torch.tensor([0.6, 0.8, 0.0]),
        torch.tensor([0.9, 0.2, 0.0]),
    )
    K = 40
    noise = lambda: 0.5 * torch.randn(K, 3, generator=gen, dtype=torch.float64)  # noqa: E731
    vectors = {"naive": naive + noise(), "config": fixed + noise(), "dense": dense + noise()}
    rep = gradient_report(vectors, "naive", "dense", draws=2000, seed=0)
    truth = {
        ("naive", "cosine"): 0.6,
        ("config", "cosine"): 0.9 / math.hypot(0.9, 0.2),
        ("naive", "relative_bias"): math.hypot(0.4, 0.8),
        ("config", "gamma"): math.hypot(0.3, 0.6),
        ("config", "cosine_gain"): 0.9 / math.hypot(0.9, 0.2) - 0.6,
    }
    for (name, stat), value in truth.items():
        got = rep[name][stat]
        assert got["low"] <= value <= got["high"], (name, stat, got, value)
        assert got["value"] == pytest.approx(value, abs=0.15)
    assert verdict(rep["config"]["gamma"], rep["config"]["cosine_gain"]) == CORRECTIONS_MATTER


def test_cosines_are_not_clamped_so_a_gain_near_1_stays_visible():
    """Two estimators both nearly parallel to dense, the corrected one more so, with noise that pushes the
    estimated cosines past 1: the unclamped gain keeps its sign in most bootstrap draws, while clamping both to 1
    makes it exactly 0 there (its lower bound then 0.0, never > 0)."""
    gen = torch.Generator().manual_seed(1)
    dense, naive, fixed = (torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.97, 0.243, 0.0, 0.0]),
                           torch.tensor([1.0, 0.0, 0.0, 0.0]))  # fmt: skip
    K = 24
    shared = torch.randn(K, 4, generator=gen, dtype=torch.float64)  # coupled samples share their noise
    own = lambda: 0.1 * torch.randn(K, 4, generator=gen, dtype=torch.float64)  # noqa: E731
    vectors = {
        "naive": naive + shared + own(),
        "config": fixed + shared + own(),
        "dense": dense + shared + own(),
    }
    free = gradient_report(vectors, "naive", "dense", draws=2000, seed=0)
    clamped = gradient_report(vectors, "naive", "dense", draws=2000, seed=0, clamp=True)
    assert free["config"]["cosine"]["high"] > 1.0  # noise does push the estimate past 1
    assert clamped["config"]["cosine_gain"]["low"] == 0.0 < free["config"]["cosine_gain"]["low"]


def test_verdict_rule():
    assert verdict({"low": 0.12, "high": 0.3}, {"low": 0.01}) == CORRECTIONS_MATTER
    assert verdict({"low": 0.12, "high": 0.3}, {"low": -0.01}) == INCONCLUSIVE  # no gain in cosine
    assert verdict({"low": 0.0, "high": 0.04}, {"low": -0.2}) == INERT
    assert verdict({"low": 0.02, "high": 0.2}, {"low": 0.1}) == INCONCLUSIVE
    assert verdict({"low": None, "high": None}, {"low": None}) == INCONCLUSIVE


def test_ratio_of_sums_and_its_complement():
    counts = bootstrap_counts(3, 500, 0)
    num, den = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])
    r = ratio_of_sums(num, den, counts)
    assert r == {"value": 0.5, "low": pytest.approx(0.5), "high": pytest.approx(0.5)}
    assert ratio_of_sums(num, den, counts, complement=True)["value"] == 0.5
    assert ratio_of_sums(num, torch.zeros(3), counts)["value"] is None


# ---------------------------------------------------------------------------------------------- the tiny model


def test_twins_agree_token_for_token_when_the_budget_is_never_reached(tmp_path):
    """Budget above the longest sequence: the evicting sampler never cuts, so each sample equals its dense twin
    and every bias statistic is 0 within float tolerance, the gradients' included."""
    cfg = tiny("kv.budget=256")
    rep = measure(cfg, BiasSettings(prompts=2, batches=3), tmp_path / "b", task=VowelTask())
    r = rep["rollout"]
    for key in ("diverged_share", "reward_flip_rate", "departed_share"):
        assert r[key]["value"] == 0.0, key
    for key in ("k1_token", "k3_token", "log_gap_seq"):
        assert abs(r[key]["value"]) < 1e-4, key
    assert r["reward_ratio"]["value"] == pytest.approx(1.0)
    records = [torch.load(p, weights_only=False) for p in sorted((tmp_path / "b" / "batches").glob("*.pt"))]
    for rec in records:
        g = rec["grads"]
        scale = float(g["dense"].norm())
        assert scale > 0
        for name in ("naive", "config", "seq-is"):
            assert float((g[name] - g["dense"]).norm()) <= 1e-4 * scale, name


def test_departure_mask_starts_at_the_first_gap():
    from sparserl.eval.bias import Coupled

    logp = torch.tensor([[-1.0, -1.0, -2.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    c = Coupled([0], [[1]], [[1, 2, 3, 4]], [[1, 2, 3, 4]], torch.zeros(1), torch.zeros(1), logp, old, mask,
                logp, old, mask, (torch.ones(1), torch.ones(1)), (1.0, 1.0))  # fmt: skip
    gaps = per_token_gaps(c)
    assert gaps["after"].tolist() == [[False, False, True, True]]
    assert float(gaps["k1"].sum()) == pytest.approx(-1.0)
    assert float(gaps["k3"][0, 2]) == pytest.approx(math.e - 2.0)


def test_an_injected_sampler_perturbation_moves_the_bias_in_the_expected_direction(tmp_path):
    """The dense sampler at its own temperature (2.0 against 1.0) differs from pi_old by construction: its
    samples leave their twins, the mismatch and the corrections' shares rise, and the corrected gradient moves
    away from the naive one (Gamma > 0); with no perturbation (1.0) nothing differs and Gamma is 0. (Whether the
    intervals cover the truth is tested on vectors with a known answer above: on the random tiny model the
    expected gradient is small against its sampling noise.)"""
    settings = BiasSettings(prompts=4, batches=6, estimators=["config", "seq-is"])
    hot_cfg = tiny("kv.method=dense", "algo.sparse_rollout=false", "rollout.sampler_temperature=2.0")
    same_cfg = tiny("kv.method=dense", "algo.sparse_rollout=false", "rollout.sampler_temperature=1.0")
    same = measure(same_cfg, settings, tmp_path / "same", task=VowelTask())
    hot = measure(hot_cfg, settings, tmp_path / "hot", task=VowelTask())
    assert same["rollout"]["diverged_share"]["value"] == 0.0
    assert hot["rollout"]["diverged_share"]["value"] > 0.5
    assert same["rollout"]["k3_token"]["value"] < 1e-6 < 0.05 < hot["rollout"]["k3_token"]["value"]
    assert hot["rollout"]["config/touched_share"]["value"] > same["rollout"]["config/touched_share"]["value"]
    assert same["estimators"]["config"]["gamma"]["value"] < 1e-3
    assert same["estimators"]["naive"]["relative_bias"]["value"] < 1e-3
    assert hot["estimators"]["config"]["gamma"]["value"] > 0.1


def test_count_sketch_keeps_the_cosines_of_full_fine_tuning_gradients():
    """Full fine-tuning of the tiny model: cosines between estimators' gradients from a CountSketch match the exact
    ones within its error (~1/sqrt(dim))."""
    cfg = tiny("kv.method=dense", "algo.sparse_rollout=false", "rollout.sampler_temperature=1.5")
    run = BiasRun(cfg, task=VowelTask())
    from sparserl.eval.bias import estimator_configs

    c = run.sample([0, 1], seed=3)
    exact = run.gradients(c, estimator_configs(cfg.algo, ["config"]), micro=8, sketch=None)
    sketch = Sketch(run.size, 2**14, seed=0)
    assert run.size > 4 * sketch.dim
    cos = lambda a, b: float(a @ b / (a.norm() * b.norm()))  # noqa: E731
    for a, b in (("naive", "dense"), ("config", "dense"), ("naive", "config")):
        assert cos(sketch(exact[a]), sketch(exact[b])) == pytest.approx(cos(exact[a], exact[b]), abs=0.05)


def test_sampler_temperature_equal_to_the_temperature_is_the_same_sampler(tmp_path):
    """rollout.sampler_temperature = rollout.temperature draws bit for bit what no setting draws; another value
    records the log-probs of its own distribution (the sampler's), not pi_old's."""
    from sparserl.engine import score

    base = BiasRun(tiny("kv.method=dense", "algo.sparse_rollout=false"), task=VowelTask())
    a = base.sample([0, 1], seed=5)
    base.cfg = tiny("kv.method=dense", "algo.sparse_rollout=false", "rollout.sampler_temperature=1.0")
    b = base.sample([0, 1], seed=5)
    assert a.sparse == b.sparse and torch.equal(a.sparse_logp, b.sparse_logp)
    base.cfg = tiny("kv.method=dense", "algo.sparse_rollout=false", "rollout.sampler_temperature=1.5")
    hot = base.sample([0, 1], seed=5)
    at_15 = score(base.policy.module, hot.prompts, hot.sparse, temperature=1.5)
    for i, row in enumerate(at_15):
        assert torch.allclose(hot.sparse_logp[i, : len(row)], row, atol=1e-4)
    assert not torch.allclose(hot.sparse_logp, hot.sparse_old, atol=1e-2)


# ---------------------------------------------------------------------------------------------- the command


def test_bias_command_writes_report_plot_and_resumes(tmp_path, capsys):
    out = tmp_path / "bias"
    args = ["bias", "model.spec=tiny-llama", "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=8",
            "kv.budget=12", "kv.interval=4", "--batches", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((out / "bias.json").read_text())
    assert report["complete"] and report["batches_done"] == 2 and (out / "bias.png").is_file()
    assert set(report["estimators"]) == {"naive", "config", "seq-is"}
    assert "verdict" in report["estimators"]["config"]
    printed = capsys.readouterr().out
    assert "reward ratio to dense twins" in printed and "config" in printed
    assert "at 2 batches these intervals hold less than their 90%" in printed
    assert main(args) == 1  # the folder exists: --resume or another --out
    assert "--resume" in capsys.readouterr().err
    (out / "batches" / "0001.pt").unlink()  # a batch lost to a kill is measured again
    assert main([*args, "--resume"]) == 0
    assert json.loads((out / "bias.json").read_text())["rollout"] == report["rollout"]
    assert main([*args[:-5], "--batches", "3", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert json.loads((out / "bias.json").read_text())["batches_done"] == 3  # more batches: the first 2 kept
    assert main([*args[:-5], "--batches", "3", "--prompts", "1", "--out", str(out), "--resume"]) == 1
    assert "settings.prompts" in capsys.readouterr().err


def test_a_measurement_split_in_parts_reports_what_one_process_reports(tmp_path, capsys):
    """--part I/N measures its contiguous share of the batches and no report; --resume then reports exactly what
    one unsplit process reports (a batch depends only on its index)."""
    common = ["bias", "model.spec=tiny-llama", "rollout.prompts_per_step=2", "rollout.n=4", "rollout.max_new_tokens=8",
              "kv.budget=12", "kv.interval=4", "--batches", "3", "--no-progress"]  # fmt: skip
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main([*common, "--out", str(whole)]) == 0
    for part in ("2/2", "1/2"):
        assert main([*common, "--out", str(split), "--part", part]) == 0
        assert not (split / "bias.json").exists()
    assert sorted(p.name for p in (split / "batches").glob("*.pt")) == ["0000.pt", "0001.pt", "0002.pt"]
    assert "once every part is done" in capsys.readouterr().out
    assert main([*common, "--out", str(split), "--resume"]) == 0
    a, b = (json.loads((d / "bias.json").read_text()) for d in (whole, split))
    assert a["rollout"] == b["rollout"] and a["estimators"] == b["estimators"]
    with pytest.raises(SystemExit):
        main([*common, "--out", str(tmp_path / "x"), "--part", "3/2"])
    assert "1 <= I <= N" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "x"), "--part", "1/4"]) == 2  # a config error
    assert "more parts than --batches 3" in capsys.readouterr().err


def test_resume_reads_a_setting_added_since_at_its_default(tmp_path):
    """A folder measured before a config field existed resumes while that field keeps its default, and refuses
    once the field is set otherwise (the saved run never had it)."""
    from sparserl.eval.bias_command import _check_out, _fingerprint

    out, s = tmp_path / "b", BiasSettings(prompts=2, batches=2)
    old = _fingerprint(tiny(), s)
    del old["config"]["optim"]["recompute_modules"]
    out.mkdir()
    (out / "settings.json").write_text(json.dumps(old))
    _check_out(out, _fingerprint(tiny(), s), resume=True)
    (out / "settings.json").write_text(json.dumps(old))
    with pytest.raises(UserError, match="optim.recompute_modules"):
        _check_out(out, _fingerprint(tiny("optim.recompute_modules=[mlp]"), s), resume=True)


def test_bias_command_refuses_unknown_estimators(tmp_path, capsys):
    code = main(
        ["bias", "model.spec=tiny-llama", "--estimators", "config,bogus", "--out", str(tmp_path / "x")]
    )
    assert code == 1
    assert "bogus" in capsys.readouterr().err


def test_block_sparse_samplers_report_alpha_p5(tmp_path):
    """A block-sparse sampler records its top-k distributions: the report carries alpha's P5 with an interval."""
    cfg = tiny("kv.method=block_topk", "kv.budget=16", "kv.page_size=4", "kv.dense_layers=[0]")
    rep = measure(cfg, BiasSettings(prompts=2, batches=2, gradients=False), tmp_path / "b", task=VowelTask())
    a = rep["rollout"]["alpha_p5_topk"]
    assert 0.0 <= a["low"] <= a["value"] <= 1.0 and a["high"] <= 1.0
    assert "alpha_p5_topk" not in measure(tiny(), BiasSettings(prompts=2, batches=2, gradients=False),
                                          tmp_path / "r", task=VowelTask())["rollout"]  # fmt: skip


def test_a_quantized_sampler_is_measured_like_any_other(tmp_path):
    """kv.quant=int8 on a dense cache: prefill exact, decode over codes; its samples leave their full-precision
    twins where a draw flips, and the report names the cache."""
    from sparserl.eval.bias_command import sampler_text

    cfg = tiny("kv.method=dense", "kv.quant=int8")
    rep = measure(cfg, BiasSettings(prompts=2, batches=2, gradients=False), tmp_path / "b", task=VowelTask())
    r = rep["rollout"]
    assert 0.0 < r["k3_token"]["value"] < 0.05  # quantization moves the sampler, a little
    assert sampler_text(cfg).startswith("dense cache, int8 keys and values")


def test_preset_estimators_smd_and_tis(tmp_path):
    """Algo presets as estimators (SMD's distillation term included) give their own gradients and shares."""
    rep = measure(tiny(), BiasSettings(prompts=2, batches=2, estimators=["smd", "tis"]), tmp_path / "b",
                  task=VowelTask())  # fmt: skip
    assert set(rep["estimators"]) == {"naive", "smd", "tis"}
    assert "smd/touched_share" in rep["rollout"] and "tis/tis_truncation_share" in rep["rollout"]
