"""Bad input to the `sparserl` command, one table row per case: each must exit non-zero with ONE clear stderr
line naming the culprit, no traceback, and (for `train`) no empty run directory left under the output dir.

Adding a case is one line above the end marker of CASES:

    case("eval-missing-data", [*EVAL, "--data", "{tmp}/missing.jsonl"], EXIT_FAILURE, r"missing\\.jsonl"),

`{tmp}` in argv is replaced by the test's tmp_path (also the working directory). `setup(tmp, monkeypatch)`
may write files or patch a failure in first (see `write`, `trained`, `full_disk`, `read_only`). `message` is a regex searched in the `sparserl <command>: ...` error line.
`xfail="needs <file> fix"` marks a case waiting for a library-side change (strict: it must fail until then).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sparserl.cli import EXIT_FAILURE, EXIT_USAGE, main
from tests.tiny import TINY_RUN

# Tiny train runs: a random 2-layer model, a few prompts and tokens, output under {tmp}/runs.
TRAIN = [
    "train",
    *TINY_RUN,
    "rollout.max_new_tokens=4",
    "trainer.eval_prompts=0",
    "task.num_examples=20",
    "trainer.steps=1",
    "logging.progress=false",
    "trainer.output_dir={tmp}/runs",
    "trainer.run_name=r",
]
# Tiny eval runs: the random test model, one prompt, one short sample.
EVAL = ["eval", "--model", "tiny-llama", "--limit", "1", "--samples", "1", "--max-new-tokens", "4", "-q"]
ROLLOUT = ["rollout", "--model", "tiny-llama", "--prompts", "1", "--n", "1", "--max-new-tokens", "4"]


Setup = Callable[[Path, pytest.MonkeyPatch], None]


def fill(argv: list[str], tmp: Path) -> list[str]:
    """`argv` with `{tmp}` replaced by the test's directory."""
    return [a.replace("{tmp}", str(tmp)) for a in argv]


def write(name: str, content: str | bytes) -> Setup:
    """A setup writing `content` (text or raw bytes) to tmp/`name`."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return setup


def write_jsonl(name: str, rows: list[dict[str, Any]]) -> Setup:
    """A setup writing `rows` as a .jsonl file tmp/`name`."""
    return write(name, "".join(json.dumps(r) + "\n" for r in rows))


def trained(*overrides: str) -> Setup:
    """A setup training the tiny run {tmp}/runs/r for one step (with `overrides`), to resume from."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        assert main(fill([*TRAIN, *overrides], tmp)) == 0

    return setup


def edit(name: str, old: str, new: str) -> Setup:
    """A setup replacing `old` by `new` in the file tmp/`name` (a hand-edited run config, say)."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = tmp / name
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new))

    return setup


def remove(folder: str, *names: str) -> Setup:
    """A setup deleting `names` from the folder tmp/`folder`."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in names:
            (tmp / folder / name).unlink()

    return setup


def chain(*setups: Setup) -> Setup:
    """A setup running `setups` in order."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        for step in setups:
            step(tmp, monkeypatch)

    return setup


def full_disk(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save fails as on a full disk: torch's own error for a path (its C++ writer drops the errno),
    OSError(ENOSPC) for a Python file object."""

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", save)


def read_only(name: str) -> Setup:
    """A setup making tmp/`name` a read-only file system (tests may run as root, where chmod does not stop
    writes): creating anything under it fails with EROFS, as on a read-only mount."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        root = tmp / name
        root.mkdir(parents=True, exist_ok=True)
        real_mkdir = os.mkdir

        def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
            if Path(path).is_relative_to(root):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)

    return setup


def locked(name: str) -> Setup:
    """A setup holding the run directory tmp/`name` as a live run would (its lock), until the test ends."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from sparserl.trainer.run_dir import RunLock

        (tmp / name).mkdir(parents=True)
        monkeypatch.setattr(sys.modules[__name__], "_held_lock", RunLock(tmp / name), raising=False)

    return setup


def model_missing_a_layer(name: str) -> Setup:
    """A setup saving the tiny test model to tmp/`name` with the weights of its second layer left out."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from safetensors.torch import load_file, save_file

        from sparserl.models import tiny_model

        model, tokenizer = tiny_model()
        model.save_pretrained(tmp / name)
        tokenizer.save_pretrained(tmp / name)
        weights = tmp / name / "model.safetensors"
        kept = {k: v for k, v in load_file(weights).items() if ".layers.1." not in k}
        save_file(kept, weights, metadata={"format": "pt"})

    return setup


def pruned_while_read(run: str) -> Setup:
    """A setup training the tiny run tmp/`run` for one step, then making its checkpoints vanish as eval reads
    their weights (a running training pruning them): the first load_file deletes the checkpoints first."""

    def setup(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        import shutil

        import safetensors.torch

        trained()(tmp, monkeypatch)
        real = safetensors.torch.load_file

        def load_file(path: Any, *args: Any, **kwargs: Any) -> Any:
            shutil.rmtree(tmp / run / "checkpoints", ignore_errors=True)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "load_file", load_file)

    return setup


def case(
    id: str, argv: list[str], code: int, message: str, setup: Setup | None = None, xfail: str = ""
) -> Any:
    """One row of the table (a pytest.param with its id)."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(argv, code, message, setup, id=id, marks=marks)


def run_dirs(output_dir: Path) -> set[Path]:
    """Every directory under a train output dir."""
    return {p for p in output_dir.rglob("*") if p.is_dir()} if output_dir.is_dir() else set()


QA = [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "What is 2 + 2?", "answer": "#### 4"}]
BAD_JSON_LINE_2 = '{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": 4\n'
NOT_UTF8_LINE_2 = b'{"question": "1+1?", "answer": "2"}\n{"question": "\xff+1?", "answer": "2"}\n'


# ------------------------------------------------------------------------------------------------ the table

CASES = [
    case("train-unknown-key", [*TRAIN, "optim.learning_rate=1"], EXIT_USAGE, r"unknown config key 'optim\.learning_rate'"),
    case("train-misspelled-task", [*TRAIN, "task.name=arithmetc"], EXIT_FAILURE, r"task\.name='arithmetc' is unknown"),
    case("train-data-bad-json", [*TRAIN, "task.name={tmp}/bad.jsonl"], EXIT_FAILURE, r"bad\.jsonl:2: not valid JSON", write("bad.jsonl", BAD_JSON_LINE_2)),
    case("train-data-not-utf8", [*TRAIN, "task.name={tmp}/bad.jsonl"], EXIT_FAILURE, r"bad\.jsonl.*UTF-8", write("bad.jsonl", NOT_UTF8_LINE_2)),
    case("train-data-no-question", [*TRAIN, "task.name={tmp}/q.jsonl"], EXIT_FAILURE, r"q\.jsonl:1: no question field.*task\.question_key", write_jsonl("q.jsonl", [{"text": "1+1?", "answer": "2"}])),
    case("train-config-not-utf8", [*TRAIN[:1], "--config", "{tmp}/c.yaml"], EXIT_USAGE, r"c\.yaml.*UTF-8", write("c.yaml", b"optim:\n  lr: 1e-5 # \xe9\n")),
    case("train-lora-resume-mismatch", ["train", "--resume", "{tmp}/runs/r", "model.lora_r=8", "trainer.steps=2"], EXIT_USAGE, r"lora_r", trained("model.lora=true", "model.lora_r=4")),
    case("train-lora-resume-edited-config", ["train", "--resume", "{tmp}/runs/r", "trainer.steps=2"], EXIT_FAILURE, r"checkpoint.*lora_r=8", chain(trained("model.lora=true", "model.lora_r=4"), edit("runs/r/config.yaml", "lora_r: 4", "lora_r: 8"))),
    case("train-full-disk", TRAIN, EXIT_FAILURE, r"No space left on device.*runs/r/checkpoints", full_disk),
    case("train-read-only-output", TRAIN, EXIT_FAILURE, r"Read-only file system.*runs", read_only("runs")),
    case("eval-missing-data", [*EVAL, "--data", "{tmp}/missing.jsonl"], EXIT_FAILURE, r"missing\.jsonl"),
    case("eval-bad-dtype", [*EVAL, "--data", "arithmetic", "--dtype", "float33"], EXIT_USAGE, r"--dtype.*float33.*float32, bfloat16, float16"),
    case("eval-bad-device", [*EVAL, "--data", "arithmetic", "--device", "gpu0"], EXIT_USAGE, r"--device.*gpu0"),
    case("eval-out-is-a-dir", [*EVAL, "--data", "arithmetic", "--out", "{tmp}"], EXIT_USAGE, r"--out.*is a directory"),
    case("eval-out-read-only", [*EVAL, "--data", "arithmetic", "--out", "{tmp}/ro/sub/r.json"], EXIT_FAILURE, r"Read-only file system.*ro/sub", read_only("ro")),
    case("eval-budget-without-kv", [*EVAL, "--data", "arithmetic", "--budget", "64"], EXIT_USAGE, r"--budget.*--kv"),
    case("eval-no-dense-without-kv", [*EVAL, "--data", "arithmetic", "--no-dense"], EXIT_USAGE, r"--no-dense leaves nothing.*--kv"),
    case("eval-no-question-names-the-flag", [*EVAL, "--data", "{tmp}/q.jsonl"], EXIT_FAILURE, r"q\.jsonl:1: no question field.*--question-key", write_jsonl("q.jsonl", [{"text": "1+1?", "answer": "2"}])),
    case("eval-no-answer-names-the-flag", [*EVAL, "--data", "{tmp}/q.jsonl"], EXIT_FAILURE, r"q\.jsonl:1: no answer field.*--answer-key", write_jsonl("q.jsonl", [{"question": "1+1?", "result": "2"}])),
    case("eval-data-not-utf8", [*EVAL, "--data", "{tmp}/bad.jsonl"], EXIT_FAILURE, r"bad\.jsonl.*UTF-8", write("bad.jsonl", NOT_UTF8_LINE_2)),
    case("rollout-unknown-task", [*ROLLOUT, "--task", "arithmetc"], EXIT_USAGE, r"--task 'arithmetc' is unknown"),
    case("rollout-missing-task-file", [*ROLLOUT, "--task", "{tmp}/missing.jsonl"], EXIT_FAILURE, r"--task .*missing\.jsonl"),
    case("rollout-negative-temperature", [*ROLLOUT, "--temperature", "-1"], EXIT_USAGE, r"--temperature=-1\.0 must be a finite number >= 0"),
    case("eval-missing-model-path", [*EVAL, "--model", "./nope", "--data", "arithmetic"], EXIT_FAILURE, r"the path \./nope does not exist"),
    case("train-missing-model-path", [*TRAIN, "model.spec=./missing_dir"], EXIT_FAILURE, r"the path \./missing_dir does not exist"),
    case("eval-prompt-longer-than-context", [*EVAL, "--data", "{tmp}/long.jsonl"], EXIT_FAILURE, r"longer than 4092 tokens.*long\.jsonl:1.*--max-new-tokens", write_jsonl("long.jsonl", [{"question": "1 + " * 5000 + "1?", "answer": "5001"}])),
    case("eval-max-new-tokens-past-context", [*EVAL, "--data", "{tmp}/qa.jsonl", "--max-new-tokens", "5000"], EXIT_FAILURE, r"--max-new-tokens=5000 leaves no room", write_jsonl("qa.jsonl", QA)),
    case("eval-negative-top-k", [*EVAL, "--data", "arithmetic", "--top-k", "-1"], EXIT_USAGE, r"--top-k=-1 must be >= 0"),
    case("eval-temperature-nan", [*EVAL, "--data", "arithmetic", "--temperature", "nan"], EXIT_USAGE, r"--temperature=nan must be a finite number"),
    case("train-reward-module-missing", [*TRAIN, "task.reward=no_such_reward_mod:f"], EXIT_FAILURE, r"task\.reward='no_such_reward_mod:f': cannot import module 'no_such_reward_mod': ModuleNotFoundError"),
    case("train-reward-no-function", [*TRAIN, "task.reward={tmp}/rw.py:f"], EXIT_FAILURE, r"rw\.py has no function 'f' \(it defines: g\)", write("rw.py", "def g(completions, **kwargs):\n    return [0.0] * len(completions)\n")),
    case("train-reward-not-a-spec", [*TRAIN, "task.reward=nocolon"], EXIT_USAGE, r"task\.reward entry 'nocolon' must be 'module:function'"),
    case("train-reward-weights-count", [*TRAIN, "task.reward=[builtin, m:f]", "task.reward_weights=[1.0]"], EXIT_USAGE, r"task\.reward_weights has 1 weights for 2"),
    case("train-prompt-template-unknown-field", [*TRAIN, "task.name={tmp}/q.jsonl", "task.prompt_template={body} {question}"], EXIT_FAILURE, r"q\.jsonl:1: task\.prompt_template names field 'body'.*question, answer", write_jsonl("q.jsonl", QA)),
    case("eval-prompt-template-unknown-field", [*EVAL, "--data", "{tmp}/q.jsonl", "--prompt-template", "{body} {question}"], EXIT_FAILURE, r"q\.jsonl:1: .*'body'.*question, answer", write_jsonl("q.jsonl", QA)),
    case("train-data-missing-file", [*TRAIN, "task.data={tmp}/nope.jsonl"], EXIT_FAILURE, r"nope\.jsonl"),
    case("train-generated-task-with-data", [*TRAIN, "task.name=arithmetic", "task.data={tmp}/q.jsonl"], EXIT_USAGE, r"task\.name='arithmetic' generates its problems and reads no data"),
    case("train-lr-nan", [*TRAIN, "optim.lr=nan"], EXIT_USAGE, r"optim\.lr='nan' is not a number"),
    case("train-lr-inf", [*TRAIN, "optim.lr=inf"], EXIT_USAGE, r"optim\.lr=inf must be a finite number"),
    case("train-resume-other-model", ["train", "--resume", "{tmp}/runs/r", "model.spec=tiny-qwen3"], EXIT_USAGE, r"model\.spec \(run: 'tiny-llama', now: 'tiny-qwen3'\).*may change only", trained()),
    case("train-run-dir-in-use", TRAIN, EXIT_FAILURE, r"runs/r is in use by another sparserl run", locked("runs/r")),
    case("train-model-missing-a-layer", [*TRAIN, "model.spec={tmp}/m"], EXIT_FAILURE, r"missing .*layers\.1\.", model_missing_a_layer("m")),
    case("train-long-prompt-error", [*TRAIN, "task.name={tmp}/long.jsonl", "task.on_long_prompt=error"], EXIT_FAILURE, r"long\.jsonl:1.*task\.on_long_prompt", write_jsonl("long.jsonl", [{"question": "1 + " * 5000 + "1?", "answer": "5001"}])),
    case("train-kv-memory-cap-below-one-sequence", [*TRAIN, "rollout.kv_memory_cap=1KB"], EXIT_USAGE, r"rollout\.kv_memory_cap=1KB .*below one sequence"),
    case("train-kv-budget-beyond-int64", [*TRAIN, "kv.budget=1e30"], EXIT_USAGE, r"kv\.budget='1e30' is out of range"),
    case("train-kv-schedule-budget-huge", [*TRAIN, "kv.schedule=[[0, 100000000000000000000000]]"], EXIT_USAGE, r"kv\.schedule.*bin 0.*at most"),
    case("calibrate-schedule-budget-huge", ["calibrate", "--model", "tiny-llama", "--schedule", "[[0, 100000000000000000000000]]"], EXIT_USAGE, r"--schedule.*bin 0.*at most"),
    case("cost-schedule-budget-huge", ["cost", "--model", "tiny-llama", "--output-len", "64", "--schedule", "[[0, 100000000000000000000000]]"], EXIT_USAGE, r"kv\.schedule.*bin 0.*at most"),
    case("eval-threads-negative", [*EVAL, "--data", "arithmetic", "--threads", "-1"], EXIT_USAGE, r"--threads: -1 must be >= 0"),
    case("rollout-threads-negative", [*ROLLOUT, "--threads", "-1"], EXIT_USAGE, r"--threads: -1 must be >= 0"),
    case("calibrate-threads-negative", ["calibrate", "--model", "tiny-llama", "--budgets", "64", "--threads", "-1"], EXIT_USAGE, r"--threads: -1 must be >= 0"),
    case("cost-output-len-past-context", ["cost", "--model", "tiny-llama", "--output-len", "100000000"], EXIT_USAGE, r"--output-len 100000000 .*beyond the model's context of 4,096"),
    case("train-seed-negative", [*TRAIN, "trainer.seed=-1"], EXIT_USAGE, r"trainer\.seed=-1 must be >= 0"),
    case("train-data-corrupt-parquet", [*TRAIN, "task.data={tmp}/bad.parquet"], EXIT_FAILURE, r"bad\.parquet: not a readable Parquet file", write("bad.parquet", b"PAR1 not really parquet")),
    case("eval-model-folder-empty", [*EVAL, "--data", "arithmetic", "--model", "{tmp}/m"], EXIT_FAILURE, r"model folder .*/m has no config\.json", write("m/.keep", "")),
    case("eval-model-no-tokenizer", [*EVAL, "--data", "arithmetic", "--model", "{tmp}/m"], EXIT_FAILURE, r"model folder .*/m has no tokenizer files", chain(model_missing_a_layer("m"), remove("m", "tokenizer.json", "tokenizer_config.json"))),
    case("eval-model-corrupt-tokenizer-json", [*EVAL, "--data", "arithmetic", "--model", "{tmp}/m"], EXIT_FAILURE, r"m/tokenizer\.json: not a valid tokenizer file", chain(model_missing_a_layer("m"), write("m/tokenizer.json", "{bad"))),
    case("eval-data-json-error-no-at-at", [*EVAL, "--data", "{tmp}/bad.jsonl"], EXIT_FAILURE, r"bad\.jsonl:1: not valid JSON \(Unterminated string starting at column \d+\)", write("bad.jsonl", '{"question": "1+1?\n')),
    case("calibrate-budgets-empty", ["calibrate", "--model", "tiny-llama", "--budgets="], EXIT_USAGE, r"--budgets='' is empty; give --budgets"),
    case("kv-schedule-not-utf8", [*TRAIN, "kv.schedule={tmp}/s.yaml"], EXIT_USAGE, r"kv\.schedule: .*s\.yaml is not UTF-8", write("s.yaml", b"[[0, 64]] # \xe9\n")),
    case("kv-schedule-directory", [*TRAIN, "kv.schedule={tmp}/sched.json"], EXIT_USAGE, r"kv\.schedule: .*sched\.json is a directory", write("sched.json/x", "")),
    case("cost-intensity-inf", ["cost", "--model", "tiny-llama", "--output-len", "64", "--intensity", "inf"], EXIT_USAGE, r"--intensity 'inf' must be a finite positive number"),
    case("train-max-new-tokens-past-context", [*TRAIN, "rollout.max_new_tokens=100000"], EXIT_USAGE, r"rollout\.max_new_tokens=100000 leaves no room for a prompt in the model's context of 4096"),
    case("eval-samples-huge", [*EVAL, "--data", "arithmetic", "--samples", "9223372036854775807"], EXIT_USAGE, r"--samples=9223372036854775807 must be at most 65,536"),
    case("rollout-n-huge", [*ROLLOUT, "--n", "9223372036854775807"], EXIT_USAGE, r"--n=9223372036854775807 must be at most 65,536"),
    case("calibrate-n-huge", ["calibrate", "--model", "tiny-llama", "--data", "arithmetic", "--budgets", "48", "--n", "9223372036854775807", "-q"], EXIT_USAGE, r"--n=9223372036854775807 must be at most 65,536"),
    case("eval-limit-past-procedural-task", [*EVAL, "--data", "arithmetic", "--limit", "9223372036854775807"], EXIT_USAGE, r"--limit=9223372036854775807 is more than the 10,000 problems arithmetic generates"),
    case("calibrate-prompts-past-procedural-task", ["calibrate", "--model", "tiny-llama", "--data", "arithmetic", "--budgets", "48", "--prompts", "100000", "-q"], EXIT_USAGE, r"--prompts=100000 is more than the 10,000 problems arithmetic generates"),
    case("rollout-max-new-tokens-past-context", [*ROLLOUT, "--max-new-tokens", "100000"], EXIT_FAILURE, r"--max-new-tokens=100000 leaves no room .* 4096 positions"),
    case("calibrate-top-logprobs-past-vocab", ["calibrate", "--model", "tiny-llama", "--data", "arithmetic", "--budgets", "48", "--n", "1", "--prompts", "1", "--max-new-tokens", "8", "--top-logprobs", "100000", "-q", "--out", "{tmp}/cal"], EXIT_USAGE, r"--top-logprobs=100000 must be in \[1, 261\]"),
    case("train-kv-memory-cap-below-a-prompt", [*TRAIN, "rollout.kv_memory_cap=4096"], EXIT_USAGE, r"rollout\.kv_memory_cap=4\.00 KiB is too small for one sequence"),
    case("eval-checkpoint-pruned-while-read", [*EVAL, "--data", "arithmetic", "--model", "{tmp}/runs/r", "--checkpoint"], EXIT_FAILURE, r"checkpoint .*runs/r/checkpoints/step-\d+ was removed while reading \(pruned by a running training\?\)", pruned_while_read("runs/r")),
    case("train-dars-key-without-dars", [*TRAIN, "sampling.dars_n_max=16"], EXIT_USAGE, r"sampling\.dars_n_max=16 applies only with sampling\.method=dars"),
    case("train-vcrl-key-without-vcrl", [*TRAIN, "sampling.vcrl_kappa=0.5"], EXIT_USAGE, r"sampling\.vcrl_kappa=0\.5 applies only with sampling\.method=vcrl"),
    case("train-spec-key-when-off", [*TRAIN, "rollout.spec.lenience=1"], EXIT_USAGE, r"rollout\.spec\.lenience=1\.0 applies only with rollout\.spec\.enable=true"),
    case("train-tree-key-when-off", [*TRAIN, "rollout.tree.forks=3"], EXIT_USAGE, r"rollout\.tree\.forks=3 applies only with rollout\.tree\.enable=true"),
    case("train-tree-advantages-without-tree", [*TRAIN, "algo.adv_transforms=[tree]"], EXIT_USAGE, r"algo\.adv_transforms=\[tree\] applies only with rollout\.tree\.enable=true"),
    case("train-judge-without-shaping", [*TRAIN, "shaping.judge=embedding"], EXIT_USAGE, r"shaping\.judge=embedding applies only with shaping\.method=uniqueness"),
    case("train-overlong-penalty-without-buffer", [*TRAIN, "algo.overlong_penalty=0.5"], EXIT_USAGE, r"algo\.overlong_penalty=0\.5 applies only with algo\.overlong_buffer > 0"),
    case("train-weight-sync-without-workers", [*TRAIN, "distributed.weight_sync=broadcast"], EXIT_USAGE, r"distributed\.weight_sync=broadcast applies only with distributed\.rollout_workers > 0"),
    case("train-partial-key-when-off", [*TRAIN, "rollout.partial.mode=mask_old"], EXIT_USAGE, r"rollout\.partial\.mode=mask_old applies only with rollout\.partial\.enable=true"),
    case("train-dynamic-sampling-n1", [*TRAIN, "rollout.n=1", "optim.grad_accum=1", "sampling.dynamic=true"], EXIT_USAGE, r"sampling\.dynamic=true with rollout\.n=1: .*set rollout\.n >= 2"),
    case("train-vcrl-n1", [*TRAIN, "rollout.n=1", "optim.grad_accum=1", "sampling.method=vcrl"], EXIT_USAGE, r"sampling\.method=vcrl with rollout\.n=1: .*set rollout\.n >= 2"),
    case("train-reward-spec-empty-module-in-list", [*TRAIN, "task.reward=[builtin, :f]"], EXIT_USAGE, r"task\.reward entry ':f' must be 'module:function'"),
    # --- add new cases above this line ---
]  # fmt: skip


# Ray that cannot be reached or cannot place the run's actors: one line, within seconds (not Ray's minutes).
RAY = [*TRAIN, "distributed.rollout_workers=1"]
CASES += [
    case("train-ray-address-garbage", [*RAY, "distributed.ray_address=garbage"], EXIT_FAILURE, r"distributed\.ray_address='garbage': Invalid address"),
    case("train-ray-address-unreachable", [*RAY, "distributed.ray_address=127.0.0.1:1"], EXIT_FAILURE, r"distributed\.ray_address='127\.0\.0\.1:1': nothing answers"),
    case("train-rollout-workers-unschedulable", [*RAY, "distributed.gpus_per_worker=1000"], EXIT_FAILURE, r"1 rollout workers cannot all be placed: .*1000 GPUs.*lower distributed\.rollout_workers"),
    case("train-learners-unschedulable", [*TRAIN, "distributed.learners=2", "distributed.gpus_per_learner=1000"], EXIT_FAILURE, r"2 learners cannot all be placed: .*1000 GPUs.*lower distributed\.learners"),
] if importlib.util.find_spec("ray") else []  # fmt: skip
CASES.append(case("train-swarm-pool-empty", [*TRAIN, "distributed.swarm.enable=true", "distributed.swarm.pool="], EXIT_USAGE, r"distributed\.swarm\.pool='' must name the pool actor"))  # fmt: skip


@pytest.mark.parametrize(("argv", "code", "message", "setup"), CASES)
def test_bad_input_is_one_clear_line(
    argv: list[str],
    code: int,
    message: str,
    setup: Setup | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path, monkeypatch)
        capsys.readouterr()
    output_dir = tmp_path / "runs"
    dirs_before = run_dirs(output_dir)
    try:
        rc = main(fill(argv, tmp_path))
    except SystemExit as e:  # argparse's usage errors: 'sparserl eval: error: ...' after the usage lines
        rc = e.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err, captured.err
    errors = [line for line in captured.err.splitlines() if line.startswith(f"sparserl {argv[0]}:")]
    assert rc == code, captured.err
    assert len(errors) == 1, captured.err
    assert re.search(message, errors[0]), errors[0]
    if argv[0] == "train":
        empty = [d for d in run_dirs(output_dir) - dirs_before if not any(p.is_file() for p in d.rglob("*"))]
        assert not empty, f"a failed start left empty directories: {empty}"
