"""`sparserl eval`, `sparserl rollout` and `sparserl plot` end to end through the CLI, on a tiny model saved
with save_pretrained and synthetic files; bad input gives one clear error line and a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparserl.cli import build_parser, main
from sparserl.config import load_config, save_config
from sparserl.models import tiny_model

SMALL_KV = ["--kv", "rkv", "--budget", "40", "--window", "4", "--interval", "4"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = tiny_model(seed=0)
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture()
def qa_file(tmp_path: Path) -> Path:
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_subcommands_registered() -> None:
    text = build_parser().format_help()
    for name in ("train", "eval", "rollout", "plot"):
        assert name in text


def test_eval_cli_dense_and_sparse(
    tiny_dir: Path, qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "out" / "report.json"
    rc, out, err = run_cli(
        capsys, "eval", "--model", str(tiny_dir), "--data", str(qa_file), *SMALL_KV,
        "--samples", "2", "--max-new-tokens", "12", "--out", str(report),
    )  # fmt: skip
    assert rc == 0, err
    result = json.loads(out)
    assert result["prompts"] == 3 and result["samples"] == 2 and result["model_kind"] == "pretrained"
    assert result["sampling"]["temperature"] == 0.8 and result["sampling"]["top_p"] == 0.95
    for mode in ("dense", "sparse"):
        for key in ("mean@2", "pass@1", "pass@2", "mean_length", "truncated_share", "peak_kv_bytes"):
            assert key in result[mode], (mode, key)
    assert result["sparse"]["compression_events"] > 0
    assert "sparse_minus_dense" in result and "examples" not in result
    saved = json.loads(report.read_text())
    assert len(saved["examples"]) == 3 and saved["examples"][1]["answer"] == "2"
    assert len(saved["examples"][0]["sparse"]["rewards"]) == 2
    assert "mean@2" in err and "dense" in err  # the human-readable table on stderr


def test_eval_cli_builtin_task_dense_only(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(
        capsys, "eval", "-m", str(tiny_dir), "-d", "arithmetic", "--kv", "dense", "--limit", "2",
        "-k", "1", "--max-new-tokens", "6", "--quiet",
    )  # fmt: skip
    assert rc == 0, err
    result = json.loads(out)
    assert result["task"] == "arithmetic" and result["prompts"] == 2
    assert "dense" in result and "sparse" not in result and result["kv"] is None
    assert err == ""  # --quiet


def test_eval_cli_without_kv_is_dense_only(
    tiny_dir: Path, qa_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --kv: no sparse pass with some default budget, only the dense one the user asked for."""
    rc, out, err = run_cli(
        capsys, "eval", "-m", str(tiny_dir), "-d", str(qa_file), "-k", "1", "--max-new-tokens", "4", "-q"
    )
    assert rc == 0, err
    result = json.loads(out)
    assert "dense" in result and "sparse" not in result and result["kv"] is None


def finished_run(tmp_path: Path, tiny_dir: Path, *overrides: str) -> Path:
    """A run directory as training leaves it: its config.yaml (the tiny model plus `overrides`) and final/."""
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(None, [f"model.spec={tiny_dir}", *overrides]), run / "config.yaml")
    model, tok = tiny_model(seed=0)
    model.save_pretrained(run / "final")
    tok.save_pretrained(run / "final")
    return run


def test_eval_cli_run_dir_uses_its_model_and_task(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = finished_run(tmp_path, tiny_dir, "task.name=long_arithmetic")
    rc, out, err = run_cli(
        capsys,
        "eval",
        "--model",
        str(run),
        *SMALL_KV,
        "--limit",
        "1",
        "-k",
        "1",
        "--max-new-tokens",
        "4",
        "-q",
    )
    assert rc == 0, err
    result = json.loads(out)
    assert result["model_kind"] == "run-final" and result["model_loaded_from"] == str(run / "final")
    assert result["task"] == "long_arithmetic"


def test_eval_cli_length_defaults_to_training_s_and_its_table_keeps_whole_headers(
    tiny_dir: Path, qa_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --max-new-tokens eval samples as long as training would (a run directory's own length, else
    rollout.max_new_tokens' default), not 1024; its table on an 80-column stderr cuts no header or label."""
    rc, out, err = run_cli(
        capsys, "eval", "--model", str(tiny_dir), "--data", str(qa_file), *SMALL_KV, "-k", "1"
    )
    assert rc == 0, err
    assert json.loads(out)["sampling"]["max_new_tokens"] == 64
    for text in ("inference", "truncated", "retained", "peak KV", "sparse rkv, budget 40"):
        assert text in err, err
    assert "\u2026" not in err  # rich's ellipsis
    run = finished_run(tmp_path, tiny_dir, "rollout.max_new_tokens=6")
    rc, out, err = run_cli(capsys, "eval", "--model", str(run), "--data", str(qa_file), "-k", "1", "-q")
    assert rc == 0, err
    assert json.loads(out)["sampling"]["max_new_tokens"] == 6


def test_eval_cli_evaluates_a_quantized_cache_alone_or_with_a_method(
    tiny_dir: Path, qa_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-quant alone quantizes a dense cache, with --kv that method's: the sparse arm is recorded with its
    quantization, named in the table, and its peak KV counts the quantized bytes (int8 holds a quarter of
    float32's, plus scales)."""
    for extra, words in ((["--kv-quant", "int8"], "dense, int8 KV"), ([*SMALL_KV, "--kv-quant", "int8"],
                         "sparse rkv, budget 40, int8 KV")):  # fmt: skip
        rc, out, err = run_cli(
            capsys, "eval", "--model", str(tiny_dir), "--data", str(qa_file), *extra, "-k", "1",
            "--max-new-tokens", "8",
        )  # fmt: skip
        assert rc == 0, err
        result = json.loads(out)
        assert result["kv"]["quant"] == "int8" and result["kv"]["described"] == words, result["kv"]
        assert words in err, err
        if "--kv" not in extra:  # same positions held: the bytes differ only by the quantization
            assert result["sparse"]["peak_kv_bytes"] < 0.5 * result["dense"]["peak_kv_bytes"], result


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (
            ["--data", "{qa}", "--kv-quant", "int4"],
            2,
            "config error: --kv-quant int4: kv.quant='int4' is unknown",
        ),
        (["--data", "{tmp}/missing.jsonl"], 1, "missing.jsonl"),
        (["--data", "{qa}", "--kv", "bogus"], 2, "'bogus' is unknown; choose one of dense, rkv"),
        (["--data", "{qa}", "--kv", "snapkv", "--budget", "4"], 2, "kv.budget=4 must exceed"),
        (["--data", "{qa}", "--samples", "0"], 2, "--samples=0 must be >= 1"),
        (["--data", "{bad}"], 1, "bad.jsonl:2"),
        ([], 2, "--data is required"),
        (["--data", "nosuchset"], 2, "--data 'nosuchset' is unknown"),
        (["--data", "{qa}", "--model", "{tmp}/no-model"], 1, "no-model"),
    ],
)
def test_eval_cli_bad_input(
    args: list[str],
    code: int,
    needle: str,
    tiny_dir: Path,
    qa_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": 4\n')
    fill = {"{tmp}": str(tmp_path), "{qa}": str(qa_file), "{bad}": str(bad)}
    argv = ["eval", "--model", str(tiny_dir), "--max-new-tokens", "4", "-q"]
    for a in args:
        for k, v in fill.items():
            a = a.replace(k, v)
        argv.append(a)
    rc, out, err = run_cli(capsys, *argv)
    assert rc == code, err
    assert needle in err and err.startswith("sparserl eval:")
    assert "Traceback" not in err and out == ""


def test_rollout_cli(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(
        capsys, "rollout", "--model", str(tiny_dir), *SMALL_KV, "--prompts", "1", "--n", "2",
        "--max-new-tokens", "16", "--show", "1",
    )  # fmt: skip
    assert rc == 0, err
    flat = " ".join(out.split())
    assert "2 completions" in flat and "tokens/s" in flat
    assert "KV memory: peak" in flat and "for the dense engine" in flat and "saved" in flat
    assert "prompt 0" in flat  # one sample shown
    rc, out, err = run_cli(
        capsys, "rollout", "--model", str(tiny_dir), *SMALL_KV, "--kv-quant", "fp8", "--prompts", "1",
        "--n", "1", "--max-new-tokens", "4", "--show", "0",
    )  # fmt: skip
    assert rc == 0 and "(1 prompts x 1, sparse rkv, budget 40, fp8 KV, interval 4)" in " ".join(
        out.split()
    ), err
    rc, _, err = run_cli(capsys, "rollout", "--model", str(tiny_dir), "--kv", "nope")
    assert rc == 2 and "'nope' is unknown" in err


def test_plot_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": s, "reward/mean": s / 10, "length/mean": 40 + s, "rejection_rate": 0.1} for s in range(1, 6)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = run_cli(capsys, "plot", str(run), "--out", str(tmp_path / "png"))
    assert rc == 0, err
    written = out.split()
    assert str(tmp_path / "png" / "overview.png") in written and all(Path(p).is_file() for p in written)
    assert "note: mismatch.png not written" in err
    rc, out, err = run_cli(capsys, "plot", str(tmp_path / "nowhere"))
    assert rc == 1 and "sparserl plot: error:" in err and "nowhere" in err
