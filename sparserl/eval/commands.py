"""The bodies of `sparserl eval` and `sparserl rollout` (argument namespaces in, exit codes out)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from sparserl.config import ConfigError
from sparserl.errors import UserError


def kv_config(
    method: str | None,
    budget: int | None = None,
    window: int | None = None,
    interval: int | None = None,
    kv_quant: str | None = None,
) -> Any:
    """KVConfig from command-line flags (None: KVConfig's default; method None: dense); a bad method, budget
    or quantization is a ConfigError naming the flags given."""
    from sparserl.engine import KVConfig

    flags = (
        ("--kv", "method", method),
        ("--budget", "budget", budget),
        ("--window", "window", window),
        ("--interval", "interval", interval),
        ("--kv-quant", "quant", kv_quant),
    )
    given = [(flag, name, v) for flag, name, v in flags if v is not None]
    try:
        return KVConfig(**{name: v for _, name, v in given})
    except ValueError as e:
        said = " ".join(f"{flag} {v}" for flag, _, v in given)
        raise ConfigError(f"{said}: {e}") from None


def _device(name: str | None) -> str:
    """The torch device `--device` names (default: cuda when available, else cpu)."""
    from sparserl.device import resolve_device

    return resolve_device(name, "--device")


def _check_dtype(name: str | None) -> None:
    """`--dtype` is one of the model dtypes sparserl loads (None: the default)."""
    from sparserl.config import DTYPES

    if name is not None and name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is unknown; choose one of {', '.join(DTYPES)}")


def _check_positive(**values: int) -> None:
    """Each flag `--name` (given as name=value) is >= 1."""
    for name, v in values.items():
        if v < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={v} must be >= 1")


# Completions per prompt (--samples, --n): each one gets its own sampling key, row and KV cache row, all made up
# front, so a huge count fails allocating (MemoryError) or runs without end; no pass@k study needs more.
MAX_SAMPLES = 2**16


def check_samples(flag: str, value: int) -> None:
    """`flag` (completions per prompt, >= 1 checked apart) is at most MAX_SAMPLES."""
    if value > MAX_SAMPLES:
        raise ConfigError(f"{flag}={value} must be at most {MAX_SAMPLES:,} (completions per prompt)")


def check_prompt_count(task: Any, flag: str, count: int) -> None:
    """A procedural task (arithmetic, long_arithmetic) generates its problems: `flag`=`count` beyond the
    `len(task)` it has (task.num_examples) would generate and sample thousands of prompts where the user most
    likely meant 'a few', so it is refused; a data file's rows are simply all taken."""
    from sparserl.eval.loading import PROCEDURAL_TASKS

    name = getattr(task, "name", "")
    if name in PROCEDURAL_TASKS and count > len(task):
        raise ConfigError(
            f"{flag}={count} is more than the {len(task):,} problems {name} generates; give at most {len(task):,}"
        )


def check_context(model: Any, task: Any, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    """Every prompt (index i of `prompt_ids`) plus --max-new-tokens fits in the model's context: a UserError
    naming --max-new-tokens (and the rows too long) before any sampling."""
    from sparserl.eval.evaluate import check_prompt_lengths

    with _flag_names({"max_new_tokens": "--max-new-tokens"}):
        check_prompt_lengths(model, task, list(range(len(prompt_ids))), prompt_ids, max_new_tokens)


def _check_sampling(temperature: float, top_p: float, top_k: int = 0) -> None:
    """Sampling flags the engine accepts: --temperature >= 0 (0: greedy), --top-p in (0, 1], --top-k >= 0."""
    if not 0 <= temperature < math.inf:
        raise ConfigError(f"--temperature={temperature} must be a finite number >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p={top_p} must be in (0, 1]")
    if top_k < 0:
        raise ConfigError(f"--top-k={top_k} must be >= 0 (0: off)")


def _prepare_out(out: str | None) -> None:
    """Check `--out` and create its directory now, so that a directory name or an unwritable place fails
    before the (long) evaluation rather than after it."""
    if not out:
        return
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name, e.g. --out {path / 'eval.json'}")
    path.parent.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def _flag_names(renames: dict[str, str]) -> Iterator[None]:
    """Re-raise bad-input errors of shared code (tasks, eval loading) with this command's flag names in
    place of the names that code knows (e.g. 'task.question_key' -> '--question-key'), so that the message
    names what the user can actually change."""
    try:
        yield
    except (UserError, FileNotFoundError) as e:
        text = str(e)
        for old, new in renames.items():
            text = text.replace(old, new)
        if text == str(e):
            raise
        raise type(e)(text) from e


DATA_KEY_FLAGS = {
    "task.question_key": "--question-key",
    "task.answer_key": "--answer-key",
    "task.prompt_template": "--prompt-template",
}


@contextlib.contextmanager
def _quiet_loading(quiet: bool) -> Iterator[None]:
    """Hide transformers' weight-loading progress bars while `quiet`."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_enabled:
            hf_logging.enable_progress_bar()


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:.2f} MiB"


def render_eval(result: dict[str, Any], console: Console) -> None:
    """A short human-readable table of the report (stderr; the JSON goes to stdout)."""
    from rich.measure import Measurement
    from rich.table import Table

    k = result["samples"]
    table = Table(
        title=f"sparserl eval: {result['model']} on {result['data']} ({result['prompts']} prompts x {k})"
    )
    for col in (
        "inference",
        f"mean@{k}",
        f"pass@{k}",
        "mean len",
        "truncated",
        "peak KV",
        "retained",
        "tok/s",
    ):
        table.add_column(col, justify="right" if col != "inference" else "left")
    for mode in ("dense", "sparse"):
        s = result.get(mode)
        if not s:
            continue
        label = mode if mode == "dense" else result["kv"]["described"]
        table.add_row(
            label,
            f"{s[f'mean@{k}']:.3f}",
            f"{s[f'pass@{k}']:.3f}",
            f"{s['mean_length']:.1f}",
            f"{s['truncated_share']:.1%}",
            _mib(s["peak_kv_bytes"]),
            f"{s['retained_fraction']:.1%}",
            f"{s['tokens_per_s']:.1f}",
        )
    # at least the table's natural width: a narrow (or absent, 80-column) terminal must not cut its headers
    width = console.width
    console.width = max(width, Measurement.get(console, console.options.update_width(1000), table).maximum)
    console.print(table)
    console.width = width


def _sparse_kv(args: argparse.Namespace) -> Any:
    """The KV policy of sparse inference: None (dense only) without `--kv` and `--kv-quant`, or when they
    name a plain dense cache; `--kv-quant` alone quantizes a dense cache. The cache-shape flags without `--kv`
    are an error, not silently ignored."""
    if args.kv is None:
        given = [f"--{k}" for k in ("budget", "window", "interval") if getattr(args, k) is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} without --kv: sparse inference is off (dense only); add --kv METHOD "
                "(e.g. --kv rkv) to evaluate it beside dense inference"
            )
    kv = kv_config(args.kv, args.budget, args.window, args.interval, args.kv_quant)
    return kv if kv.sparse else None


def eval_command(args: argparse.Namespace) -> int:
    """`sparserl eval`: load model and prompts, evaluate dense (and with --kv sparse), print JSON, write
    --out. Bad input (a flag, a data row, a prompt longer than the model's context) raises a UserError that
    `sparserl.cli.main` prints as one line."""
    from sparserl.eval.evaluate import evaluate, write_json
    from sparserl.eval.loading import default_limit, default_max_new_tokens, load_eval_model, load_eval_task

    if args.max_new_tokens is None:
        args.max_new_tokens = default_max_new_tokens(args.model)
    _check_positive(
        samples=args.samples, max_new_tokens=args.max_new_tokens, batch_prompts=args.batch_prompts
    )
    check_samples("--samples", args.samples)
    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit={args.limit} must be >= 0 (0: all prompts)")
    _check_sampling(args.temperature, args.top_p, args.top_k)
    _check_dtype(args.dtype)
    device = _device(args.device)
    kv = _sparse_kv(args)
    if kv is None and args.no_dense:
        raise ConfigError(
            "--no-dense leaves nothing to evaluate: add --kv METHOD (or --kv-quant) for sparse inference"
        )
    _prepare_out(args.out)
    console = Console(stderr=True, quiet=args.quiet)
    with _flag_names(DATA_KEY_FLAGS):
        task = load_eval_task(
            args.data, args.split, args.model, args.question_key, args.answer_key, args.prompt_template
        )
    limit = default_limit(task) if args.limit is None else args.limit
    check_prompt_count(task, "--limit", limit)
    console.print(f"loading model {args.model} ...", highlight=False)
    with _quiet_loading(args.quiet):
        loaded = load_eval_model(args.model, args.dtype, device, use_checkpoint=args.checkpoint)
    if args.threads:
        torch.set_num_threads(args.threads)

    def progress(mode: str, done: int, total: int) -> None:
        console.print(f"  {mode}: {done}/{total} prompts", highlight=False)

    t0 = time.perf_counter()
    with _flag_names({"max_new_tokens": "--max-new-tokens"}):
        result = evaluate(
            loaded.model,
            loaded.tokenizer,
            task,
            kv=kv,
            samples=args.samples,
            limit=limit,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            batch_prompts=args.batch_prompts,
            dense=not args.no_dense,
            details=bool(args.out),
            progress=progress,
        )
    header = {
        "model": args.model,
        "model_loaded_from": loaded.path,
        "model_kind": loaded.kind,
        **({"model_info": loaded.info} if loaded.info else {}),
        "data": args.data if args.data is not None else f"{args.model} (the run's task)",
        "split": args.split,
        "wall_s": time.perf_counter() - t0,
    }
    result = {**header, **result}
    summary = {k: v for k, v in result.items() if k != "examples"}
    print(json.dumps(summary, indent=2))
    render_eval(result, console)
    if args.out:
        path = write_json(result, args.out)
        console.print(f"report (with per-prompt results) written to {path}", highlight=False)
    return 0


def rollout_command(args: argparse.Namespace) -> int:
    """`sparserl rollout`: sample a few completions and show them with tokens/s and KV memory."""
    from rich.panel import Panel

    from sparserl.engine import RolloutEngine
    from sparserl.eval.loading import eval_task_config, load_eval_model
    from sparserl.models import encode_prompt
    from sparserl.tasks import make_task

    _check_positive(prompts=args.prompts, n=args.n, max_new_tokens=args.max_new_tokens)
    check_samples("--n", args.n)
    _check_sampling(args.temperature, args.top_p)
    kv = kv_config(args.kv, args.budget, args.window, args.interval, args.kv_quant)
    device = _device(args.device)
    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    # eval_task_config speaks of --data, the eval flag; here the prompts come from --task.
    with _flag_names({"--data": "--task", **DATA_KEY_FLAGS}):
        task = make_task(eval_task_config(args.task, "test", args.question_key, args.answer_key), "test")
    check_prompt_count(task, "--prompts", args.prompts)
    count = min(args.prompts, len(task))
    examples = [task[i] for i in range(count)]
    console.print(f"loading model {args.model} ...", highlight=False)
    loaded = load_eval_model(args.model, None, device)
    engine = RolloutEngine(loaded.model, loaded.tokenizer, kv if kv.sparse else None)
    prompts = [encode_prompt(loaded.tokenizer, ex.messages) for ex in examples]
    check_context(loaded.model, task, prompts, args.max_new_tokens)
    out = engine.generate(
        prompts,
        n=args.n,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    tok = loaded.tokenizer
    for s in out.samples[: args.show]:
        ex = examples[s.prompt_index]
        text = tok.decode(s.completion_ids, skip_special_tokens=True)
        reward = task.score(text, ex)
        console.print(
            Panel(
                f"[cyan]Q:[/cyan] {ex.messages[-1]['content'][-300:]}\n[green]A:[/green] {text}",
                title=f"prompt {s.prompt_index}, {len(s.completion_ids)} tokens, {s.finish_reason}, "
                f"reward {reward:.0f} (answer {ex.answer})",
                title_align="left",
            ),
            highlight=False,
        )
    st = out.stats
    rows = len(out)
    dense_bytes = st["peak_dense_kv_bytes"]  # the dense engine's own allocation for this batch
    dense_positions = max(len(prompts[s.prompt_index]) + len(s.completion_ids) for s in out.samples)
    mode = kv.describe() + (f", interval {kv.interval}" if kv.evicting else "")
    console.print(
        f"[bold]{rows} completions[/bold] ({count} prompts x {args.n}, {mode}): "
        f"{int(st['generated_tokens'])} tokens in {st['prefill_s'] + st['decode_s']:.2f}s = "
        f"[bold]{st['tokens_per_s']:.1f} tokens/s[/bold] (prefill {st['prefill_s']:.2f}s, "
        f"compression {st['compress_s']:.2f}s)",
        highlight=False,
    )
    console.print(
        f"KV memory: peak [bold]{_mib(st['peak_kv_bytes'])}[/bold] vs {_mib(dense_bytes)} for the dense engine "
        f"on the same batch ({max(0.0, 1 - st['peak_kv_bytes'] / dense_bytes):.1%} saved); at most "
        f"{int(st['peak_kv_positions'])} positions held per sequence (dense: {dense_positions}); "
        f"retained fraction {st['retained_fraction']:.1%}, {int(st['compression_events'])} compression events",
        highlight=False,
    )
    return 0
