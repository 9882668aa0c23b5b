"""Calibration (`sparserl calibrate`): the schedule chosen from a P5 table (hand-made tables, a hypothesis
property), calibrating tiny models with block_topk and every eviction method (JSON, heatmap, a schedule that
kv.schedule reads and a training step uses), a covering budget's P5 of 1, too-few-token bins, the held-out
check, and bad input named before any sampling."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trainer import make_trainer, rows, tiny_cfg

from sparserl import cli
from sparserl.algo.acceptance import TOO_FEW_TOKENS
from sparserl.engine import KVConfig
from sparserl.engine.kv_config import EVICTION_METHODS
from sparserl.engine.schedule import parse_schedule
from sparserl.errors import UserError
from sparserl.eval.calibrate import (
    NO_BUDGET_PASSES,
    PASSES,
    CalibrationSettings,
    budget_grid,
    calibrate,
    check_schedule,
    choose_schedule,
    write_outputs,
)
from sparserl.eval.calibrate_command import calibrate_command
from sparserl.models import encode_prompt, tiny_model

ALPHA_TOL = 1e-4  # alpha of a dense-equivalent run: 1 up to the sampler/scorer round-off (test_acceptance.py)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COVERING = 256  # more positions than any test sequence holds: reads (block_topk) or keeps (eviction) them all


@functools.cache
def tiny():
    """The `tiny-llama` model spec's model (2 layers): block_topk keeps layer 0 dense, layer 1 sparse."""
    return tiny_model("llama", seed=0)


def prompts(*sizes: int) -> list[list[int]]:
    _, tok = tiny()
    return [encode_prompt(tok, [{"role": "user", "content": "Count: " + "ab" * k}]) for k in sizes]


def block_settings(**kw) -> CalibrationSettings:
    base = dict(kv_options={"page_size": 4, "dense_layers": [0]}, n=2, max_new_tokens=40, bin_width=16)
    return CalibrationSettings("block_topk", **(base | kw), ignore_eos=True)


# ---------------------------------------------------------------------------------------------- the rule


def test_schedule_from_a_hand_made_table():
    budgets = [64, 128, 256]
    p5 = [  # bins: too few | 128 passes | 64 passes (raised to 128) | none passes | too few (trailing)
        [None, 0.50, 0.90, 0.10],
        [None, 0.87, 0.95, 0.20],
        [None, 0.99, 0.99, 0.30],
    ]
    p5 = [row + [None] for row in p5]
    table, records = choose_schedule(budgets, p5, bin_width=512, tau=0.86)
    assert table == [[0, 128], [512, 128], [1024, 128], [1536, 256], [2048, 256]]
    assert [r["chosen"] for r in records] == [128, 128, 64, 256, 256]
    reasons = [r["reason"] for r in records]
    assert reasons[0] == f"{TOO_FEW_TOKENS}: the first measured bin's budget"
    assert reasons[1] == PASSES and reasons[2].startswith(PASSES) and "non-decreasing" in reasons[2]
    assert reasons[3] == NO_BUDGET_PASSES and reasons[4] == f"{TOO_FEW_TOKENS}: the previous bin's budget"
    assert parse_schedule(table) == table  # the format kv.schedule reads


def test_p5_equal_to_tau_passes_and_a_lone_bin_is_one_row():
    assert choose_schedule([16, 32], [[0.86], [1.0]], 100, 0.86)[0] == [[0, 16]]
    assert choose_schedule([16, 32], [[0.85], [0.86]], 100, 0.86)[0] == [[0, 32]]


def test_a_table_with_no_measured_bin_is_an_error():
    with pytest.raises(UserError, match="no length bin has enough tokens"):
        choose_schedule([16, 32], [[None, None], [None, None]], 100, 0.86)


cell = st.one_of(st.none(), st.floats(0.0, 1.0))


@settings(max_examples=100, deadline=None)
@given(
    budgets=st.lists(st.integers(1, 4096), min_size=1, max_size=5, unique=True).map(sorted),
    bins=st.integers(1, 8),
    tau=st.floats(0.05, 1.0),
    data=st.data(),
)
def test_schedule_property(budgets, bins, tau, data):
    p5 = [data.draw(st.lists(cell, min_size=bins, max_size=bins)) for _ in budgets]
    if all(v is None for row in p5 for v in row):
        return
    table, records = choose_schedule(budgets, p5, 10, tau)
    assert [start for start, _ in table] == [10 * c for c in range(bins)]
    chosen = [b for _, b in table]
    assert chosen == sorted(chosen) and set(chosen) <= set(budgets)
    for c, budget in enumerate(chosen):
        passing = [b for b, row in zip(budgets, p5, strict=True) if row[c] is not None and row[c] >= tau]
        if passing:  # never below the smallest passing budget; exactly it unless raised by an earlier bin
            assert budget >= passing[0] and (budget == passing[0] or budget == max(chosen[:c]))
    assert parse_schedule(table) == table


# ---------------------------------------------------------------------------------------------- tiny models


def test_calibrate_writes_json_png_and_a_schedule_a_training_step_uses(tmp_path: Path):
    model, tok = tiny()
    report = calibrate(model, tok, prompts(1, 6), [COVERING, 12, 24], block_settings())
    paths = write_outputs(report, tmp_path / "cal")
    assert [p.name for p in paths] == ["calibration.json", "calibration.png", "schedule.json"]
    saved = json.loads(paths[0].read_text())
    assert [row["budget"] for row in saved["table"]] == [12, 24, COVERING]
    assert {len(row["bins"]) for row in saved["table"]} == {len(saved["bins"])}
    cell = saved["table"][0]["bins"][2]
    assert set(cell) >= {"p5", "p1", "mean", "frac_below_tau", "tokens", "start", "end"}
    assert saved["settings"]["tau"] == 0.86 and saved["settings"]["method"] == "block_topk"
    assert paths[1].read_bytes()[:8] == PNG_MAGIC
    # block_topk never evicts: the covering budget passes every measured bin, the tight ones do not here
    assert all(r["reason"].startswith((PASSES, TOO_FEW_TOKENS)) for r in saved["schedule_bins"])
    kv = KVConfig(method="block_topk", page_size=4, dense_layers=[0], schedule=str(paths[2]))
    assert kv.schedule == saved["schedule"]
    cfg = tiny_cfg(tmp_path, "kv.method=block_topk", f"kv.schedule={paths[2]}", "kv.page_size=4",
                   "kv.dense_layers=[0]", "trainer.steps=1")  # fmt: skip
    trainer = make_trainer(cfg)
    trainer.train()
    engine = trainer.rollouts.backend.engine  # the one the rollouts ran on
    assert engine.kv.schedule == saved["schedule"] and engine.step_budget is not None
    assert [r["step"] for r in rows(tmp_path / "run") if "reward/mean" in r] == [1]


@pytest.mark.parametrize("method", ["block_topk", *EVICTION_METHODS])
def test_a_covering_budget_has_p5_one_and_a_tight_one_less(method):
    model, tok = tiny()
    options = (
        {"page_size": 4, "dense_layers": [0]} if method == "block_topk" else {"window": 4, "interval": 4}
    )
    s = CalibrationSettings(method, options, n=2, max_new_tokens=40, bin_width=64, ignore_eos=True)
    report = calibrate(model, tok, prompts(1), [12, COVERING], s)
    tight, covering = ([b for b in row["bins"] if b["p5"] is not None] for row in report["table"])
    assert covering and all(b["p5"] > 1 - ALPHA_TOL and b["frac_below_tau"] == 0 for b in covering)
    assert min(b["p5"] for b in tight) < 0.86
    assert report["schedule"][-1][1] == COVERING


def test_too_few_token_bins_are_reported_and_inherit(tmp_path: Path):
    model, tok = tiny()
    (prompt,) = prompts(1)
    width, new, samples = len(prompt) - 2, 30, 2  # bin 0 holds only the prompt, bin 2 the last few tokens
    expected = [0, samples * (2 * width - len(prompt)), samples * (len(prompt) + new - 2 * width)]
    assert expected[1] >= 20 > expected[2]
    report = calibrate(
        model, tok, [prompt], [12, COVERING], block_settings(max_new_tokens=new, bin_width=width)
    )
    for row in report["table"]:
        assert [b["tokens"] for b in row["bins"]] == expected
        for b in (row["bins"][0], row["bins"][2]):
            assert b["note"] == TOO_FEW_TOKENS and b["p5"] is None and b["mean"] is None
    records = report["schedule_bins"]
    assert [r["reason"].split(":")[0] for r in records] == [TOO_FEW_TOKENS, PASSES, TOO_FEW_TOKENS]
    assert [budget for _, budget in report["schedule"]] == [records[1]["budget"]] * 3
    assert write_outputs(report, tmp_path)[1].read_bytes()[:8] == PNG_MAGIC


def test_held_out_check_with_the_schedule_itself(tmp_path: Path):
    model, tok = tiny()
    s = block_settings()
    passing = check_schedule(model, tok, prompts(3, 9), [[0, 12], [16, COVERING]], s)
    assert passing["kind"] == "schedule_check" and passing["all_pass"] is True
    assert all(v["passes"] in (True, None) for v in passing["verdict"])
    failing = check_schedule(model, tok, prompts(3, 9), [[0, 12]], s)
    assert failing["all_pass"] is False
    json_path, png = write_outputs(failing, tmp_path)
    assert json.loads(json_path.read_text())["schedule"] == [[0, 12]] and png.read_bytes()[:8] == PNG_MAGIC


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tau": 0.0}, r"tau=0.0 must be in \(0, 1\]"),
        ({"tau": 1.5}, r"tau=1.5 must be in \(0, 1\]"),
        ({"bin_width": 0}, "bin_width=0 must be an integer >= 1"),
        ({"method": "dense"}, "method='dense' cannot be calibrated"),
        ({"estimate": "mean"}, "estimate='mean' is unknown"),
        ({"n": 0}, "n=0 must be >= 1"),
        ({"kv_options": {"page_size": 0}}, "kv.page_size=0 must be >= 1"),
        ({"kv_options": {"budget": 64}}, "kv_options may not set budget"),
    ],
)
def test_bad_settings_are_named(change, message):
    with pytest.raises(UserError, match=message):
        CalibrationSettings(**({"method": "block_topk"} | change))


@pytest.mark.parametrize(
    ("method", "budgets", "message"),
    [
        ("block_topk", [], "budgets is empty"),
        (
            "block_topk",
            [64, 100],
            "candidate budget 100 does not suit block_topk: it is not a multiple of kv.page",
        ),
        (
            "block_topk",
            [32],
            "candidate budget 32 does not suit block_topk: it is below the always-read pages",
        ),
        (
            "snapkv",
            [8, 64],
            "candidate budget 8 does not suit snapkv: it must exceed the always-kept positions",
        ),
        ("streaming_llm", [12], r"candidate budget 12 does not suit streaming_llm: .*window 8 \+ 4 sinks"),
    ],
)
def test_bad_budgets_are_named_before_any_sampling(method, budgets, message):
    with pytest.raises(UserError, match=message):  # model None: nothing is sampled before the check
        calibrate(None, None, [[1, 2, 3]], budgets, CalibrationSettings(method))


def test_too_few_tokens_everywhere_is_an_error():
    model, tok = tiny()
    with pytest.raises(UserError, match="no length bin has enough tokens"):
        calibrate(model, tok, prompts(1), [12], block_settings(n=1, max_new_tokens=5))


# ---------------------------------------------------------------------------------------------- the command


def command_args(tmp_path: Path, **change) -> argparse.Namespace:
    """The namespace `sparserl calibrate` parses, for a tiny run (the CLI block's defaults, resized)."""
    values = dict(
        model="tiny-llama", data="arithmetic", split="test", prompts=1, offset=0, question_key="",
        answer_key="", method="block_topk", budgets="12,256", schedule=None, n=2, max_new_tokens=24,
        bin_width=64, tau=0.86, estimate="exact", top_logprobs=20, temperature=1.0, top_p=1.0, top_k=0, seed=0,
        ignore_eos=True, samples_per_call=0, resamples=200, resume=False, lengths=None, page_size=4,
        dense_layers="0",
        window=None, interval=None,
        out=str(tmp_path / "out"), checkpoint=False, dtype=None, device="cpu", threads=0, quiet=True,
    )  # fmt: skip
    return argparse.Namespace(**(values | change))


def test_command_calibrates_then_checks_on_other_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert calibrate_command(command_args(tmp_path)) == 0
    out = tmp_path / "out"
    saved = json.loads((out / "calibration.json").read_text())
    assert saved["command"].startswith("sparserl calibrate --model tiny-llama --data arithmetic")
    assert "--budgets 12,256" in saved["command"] and saved["source"]["prompt_indices"] == [0]
    assert f"kv.schedule={out / 'schedule.json'}" in capsys.readouterr().out
    schedule = str(out / "schedule.json")
    assert calibrate_command(command_args(tmp_path, budgets=None, schedule=schedule, offset=5)) == 0
    check = json.loads((out / "check.json").read_text())
    assert check["source"]["prompt_indices"] == [5] and check["schedule"] == saved["schedule"]
    printed = capsys.readouterr().out
    assert "all bins p5_low >= 0.86" in printed and "schedule  bin" in printed and " [" in printed
    # both reports carry their goal in the results format, measured from their own table (the lower bounds)
    ((name, goal),) = saved["goals"].items()
    assert goal["target"] == 1.0 and goal["command"] == saved["command"] and "lower bound" in name
    assert json.loads((out / "schedule.json").read_text())["goals"] == saved["goals"]
    ((name, goal),) = check["goals"].items()
    lowest = min(v["p5_low"] for v in check["verdict"] if v["p5_low"] is not None)
    assert goal == {"value": lowest, "target": 0.86, "met": lowest >= 0.86, "command": check["command"]}


def test_a_schedule_calibrated_for_another_method_is_warned_about_once(tmp_path: Path):
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps({"method": "rkv", "schedule": [[0, 48]]}))
    args = command_args(
        tmp_path, budgets=None, schedule=str(schedule), method="snapkv", n=1, max_new_tokens=8
    )
    with pytest.warns(UserWarning) as seen:
        assert calibrate_command(args) == 0
    said = [str(w.message) for w in seen if "calibrated for method 'rkv'" in str(w.message)]
    assert len(said) == 1, said


def test_command_resumes_from_its_finished_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A calibration stopped after its first unit goes on with --resume: the finished unit is read, not sampled
    again, and the report is the uninterrupted one's; a unit measured under other flags (or another prompt) is
    measured again, never mixed in."""
    import sparserl.eval.calibrate as calibration

    args = command_args(tmp_path, prompts=2, budgets="12:20:1.5")  # a grid: 12, 16, 20 (pages of 4)
    assert calibrate_command(args) == 0
    whole = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert [row["budget"] for row in whole["table"]] == [12, 16, 20]
    units = sorted(p.name for p in (tmp_path / "out" / "units").glob("*.safetensors"))
    assert units == [f"{b}-prompt{p}.safetensors" for b in (12, 16, 20) for p in (0, 1)]
    for name in units[1:]:
        (tmp_path / "out" / "units" / name).unlink()  # as if stopped after the first unit
    measured = []
    real = calibration.measure_unit
    monkeypatch.setattr(calibration, "measure_unit", lambda *a: measured.append(a[2]) or real(*a))
    assert calibrate_command(command_args(tmp_path, prompts=2, budgets="12:20:1.5", resume=True)) == 0
    assert len(measured) == 5  # the five missing units only
    resumed = json.loads((tmp_path / "out" / "calibration.json").read_text())
    assert resumed["table"] == [row | {"wall_s": r["wall_s"]} for row, r in zip(whole["table"],
                                resumed["table"], strict=True)]  # fmt: skip
    measured.clear()
    assert calibrate_command(command_args(tmp_path, prompts=2, budgets="12:20:1.5", resume=True, n=3)) == 0
    assert len(measured) == 6  # every unit's fingerprint names n=4: all measured again
    measured.clear()
    assert calibrate_command(command_args(tmp_path, prompts=2, budgets="12:20:1.5", resume=True, n=3)) == 0
    assert measured == []  # and kept under n=3


def test_budget_grid_steps_and_thin_cells_are_flagged():
    grid = budget_grid(64, 1024, 1.33, 16)
    assert grid[0] == 64 and grid[-1] == 1024 and all(b % 16 == 0 for b in grid)
    assert all(1.2 <= b / a <= 1.45 for a, b in itertools.pairwise(grid)), grid
    with pytest.raises(UserError, match="ratio"):
        budget_grid(64, 1024, 1.0, 16)
    model, tok = tiny()
    report = calibrate(model, tok, prompts(1), [12, COVERING], block_settings(resamples=100))
    assert report["judged_by"] == "p5_low" and report["interval_level"] == 0.9
    assert any("fewer than 32 sequences (the fewest: 2)" in w for w in report["warnings"])
    cells = [b for row in report["table"] for b in row["bins"] if b["p5"] is not None]
    assert all(b["sequences"] == 2 and b["p5_low"] <= b["p5_high"] for b in cells)
    covering = [b for b in report["table"][-1]["bins"] if b["p5"] is not None]
    assert all(b["p5_low"] > 1 - ALPHA_TOL for b in covering)  # every token's alpha is 1: so is every draw
    plain = calibrate(model, tok, prompts(1), [12, COVERING], block_settings(resamples=0))
    assert plain["judged_by"] == "p5" and all(b["p5_low"] is None for r in plain["table"] for b in r["bins"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bin_width": 0}, "--bin-width=0 must be"),
        ({"budgets": "12,x"}, "--budgets '12,x': expected comma-separated integers"),
        (
            {"budgets": "12,30"},
            "candidate budget 30 does not suit block_topk: it is not a multiple of --page-size",
        ),
        ({"schedule": "missing.json", "budgets": None}, "the schedule file 'missing.json' does not exist"),
        ({"budgets": None}, "give --budgets"),
        ({"schedule": "[[0, 12]]"}, "not both"),
        ({"offset": 10**6}, "--offset 1000000 is past the last"),
    ],
)
def test_command_bad_input_is_one_named_error(tmp_path: Path, change, message):
    with pytest.raises(UserError, match=message):
        calibrate_command(command_args(tmp_path, **change))


@pytest.mark.skipif(
    "calibrate" not in cli.COMMANDS, reason="the `calibrate` block is not in sparserl/cli.py yet"
)
def test_cli_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "cli"
    argv = ["calibrate", "--model", "tiny-llama", "--data", "arithmetic", "--prompts", "1", "--n", "2",
            "--max-new-tokens", "24", "--bin-width", "64", "--budgets", "12,256", "--page-size", "4",
            "--dense-layers", "0", "--ignore-eos", "--device", "cpu", "--quiet", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0 and (out / "schedule.json").is_file()
    assert cli.main([*argv, "--tau", "1.5"]) == cli.EXIT_USAGE
    assert "tau=1.5 must be in (0, 1]" in capsys.readouterr().err


def test_graded_length_prompts_land_near_their_targets(tmp_path: Path):
    """--lengths scales long_arithmetic's filler so each prompt ends near its target (within 5%), --prompts of
    each; the report's source says what each prompt is; another task is refused by name."""
    assert calibrate_command(command_args(tmp_path, data="long_arithmetic", lengths="600,1000", prompts=2,
                                          bin_width=200, budgets="12,256")) == 0  # fmt: skip
    source = json.loads((tmp_path / "out" / "calibration.json").read_text())["source"]
    graded = source["graded_lengths"]
    assert [(d["target"], d["index"]) for d in graded] == [(600, 0), (600, 1), (1000, 0), (1000, 1)]
    assert all(abs(d["tokens"] - d["target"]) <= 0.05 * d["target"] for d in graded), graded
    with pytest.raises(UserError, match="--lengths needs --data long_arithmetic"):
        calibrate_command(command_args(tmp_path, lengths="600"))
    with pytest.raises(UserError, match=r"--lengths 100: this task's prompt is \d+ tokens before any filler"):
        calibrate_command(command_args(tmp_path, data="long_arithmetic", lengths="100"))


def test_graded_prompts_past_a_limit_lose_filler_until_they_fit():
    """A filler line costs a few percent more in some problems, so a prompt can overshoot a target set near the
    context (the frontier's 8192 gave 8,249 tokens): with max_tokens those lose lines until they fit; the others
    are the same prompts as without the limit."""
    from sparserl.eval.calibrate_prompts import graded_length_prompts
    from sparserl.models import tiny_model
    from sparserl.tasks import TaskConfig, make_task

    _, tok = tiny_model("llama", seed=0)
    task = make_task(TaskConfig(name="long_arithmetic"), "test")
    free, described = graded_length_prompts(task, tok, [900], 6)
    limit = sorted(len(p) for p in free)[3]  # the three longest overshoot it
    capped, capped_described = graded_length_prompts(task, tok, [900], 6, max_tokens=limit)
    assert all(len(p) <= limit for p in capped) and max(map(len, free)) > limit
    for a, b, d in zip(free, capped, capped_described, strict=True):
        assert (a == b) == (len(a) <= limit) and d["tokens"] == len(b)
    assert [d["distractors"] for d in capped_described] != [d["distractors"] for d in described]
