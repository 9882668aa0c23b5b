"""`sparserl calibrate`: the flags checked, the model and prompts loaded, the calibration (or, with
--schedule, the check of a schedule) run through sparserl/eval/calibrate.py, the outputs written."""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sparserl.config import ConfigError
from sparserl.engine.schedule import parse_schedule
from sparserl.errors import UserError
from sparserl.eval.calibrate import (
    SCHEDULE_JSON,
    CalibrationSettings,
    ProgressFn,
    budget_grid,
    calibrate,
    candidate_kv_configs,
    check_schedule,
    report_goals,
    write_outputs,
)
from sparserl.signals import stoppable

UNITS_DIR = "units"  # under --out: the finished (KV policy, prompt) units that --resume reads


def command_line(args: argparse.Namespace, name: str = "calibrate") -> str:
    """The command as it would be typed, every flag explicit (each argument's dest is its flag's name)."""
    parts = ["sparserl", name]
    for key, value in vars(args).items():
        if key.startswith("_") or key == "command" or value is None or value is False or value == "":
            continue
        parts.append(f"--{key.replace('_', '-')}")
        if value is not True:
            parts.append(str(value))
    return shlex.join(parts)


def _int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers of a flag; anything else is a ConfigError naming it."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        return [int(t) for t in items]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers, e.g. 64,128,256") from None


def _budgets(text: str, multiple: int) -> list[int]:
    """--budgets: comma-separated budgets, or LOW:HIGH:RATIO for a grid (`budget_grid`, multiples of
    `multiple`)."""
    if ":" not in str(text):
        return _int_list(text, "--budgets")
    try:
        low, high, ratio = str(text).split(":")
        return budget_grid(int(low), int(high), float(ratio), multiple)
    except ValueError:
        raise ConfigError(f"--budgets {text!r}: a grid is LOW:HIGH:RATIO, e.g. 64:1024:1.33") from None


def _settings_from_flags(args: argparse.Namespace) -> tuple[CalibrationSettings, list[int]]:
    """The calibration settings and candidate budgets (none with --schedule) from the flags, every budget or
    schedule bin checked; bad flags are ConfigErrors (usage errors) naming them."""
    from sparserl.eval.commands import _flag_names

    if bool(args.schedule) == bool(args.budgets):
        empty = [f"{flag}={value!r} is empty; " for flag, value in (("--budgets", args.budgets),
                 ("--schedule", args.schedule)) if value is not None and not value]  # fmt: skip
        raise ConfigError(
            "".join(empty)
            + "give --budgets (candidate budgets to calibrate, e.g. 64,128,256,512) or --schedule "
            "(a schedule to check on held-out prompts)"
            + (", not both" if args.schedule and args.budgets else "")
        )
    kv_options = {"page_size": args.page_size, "dense_layers": _int_list(args.dense_layers, "--dense-layers")}
    kv_options |= {k: getattr(args, k) for k in ("window", "interval") if getattr(args, k) is not None}
    flags = ("bin_width", "max_new_tokens", "top_logprobs", "samples_per_call", "kv.page_size", "kv.window",
             "kv.interval", "kv.dense_layers")  # fmt: skip
    try:
        with _flag_names({name: "--" + name.removeprefix("kv.").replace("_", "-") for name in flags}):
            settings = CalibrationSettings(
                args.method, kv_options, args.n, args.max_new_tokens, args.bin_width, args.tau, args.estimate,
                args.top_logprobs, args.temperature, args.top_p, args.top_k, args.seed, args.ignore_eos,
                args.samples_per_call, args.resamples,
            )  # fmt: skip
            if args.schedule:
                settings.kv(schedule=parse_schedule(args.schedule, "--schedule"))  # check_schedule warns once
                return settings, []
            budgets = _budgets(args.budgets, args.page_size if args.method == "block_topk" else 16)
            candidate_kv_configs(settings, budgets)
            return settings, budgets
    except UserError as e:
        raise ConfigError(str(e)) from None


@stoppable(
    "sparserl calibrate",
    "its outputs were not written; the units it finished are kept: add --resume to the same command to go on",
)
def calibrate_command(args: argparse.Namespace) -> int:
    """`sparserl calibrate`: check the flags, load the model and prompts, calibrate (or, with --schedule,
    check a schedule on these prompts), write the outputs under --out and print the schedule and warnings."""
    import torch
    from rich.console import Console

    from sparserl.eval.commands import (
        DATA_KEY_FLAGS,
        _check_dtype,
        _check_sampling,
        _device,
        _flag_names,
        check_prompt_count,
        check_samples,
    )
    from sparserl.eval.loading import load_eval_model, load_eval_task

    settings, budgets = _settings_from_flags(args)
    _check_sampling(args.temperature, args.top_p, args.top_k)
    _check_dtype(args.dtype)
    if args.prompts < 1 or args.offset < 0:
        raise ConfigError(f"--prompts={args.prompts} must be >= 1 and --offset={args.offset} >= 0")
    check_samples("--n", args.n)
    out = Path(args.out)
    if out.is_file():
        raise ConfigError(f"--out {args.out} is a file; give a directory for the JSON, PNG and schedule")
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True, quiet=args.quiet)
    with _flag_names(DATA_KEY_FLAGS):
        task = load_eval_task(args.data, args.split, args.model, args.question_key, args.answer_key)
    check_prompt_count(task, "--prompts", args.prompts)
    indices = list(range(args.offset, min(args.offset + args.prompts, len(task))))
    if not indices:
        raise ConfigError(f"--offset {args.offset} is past the last of the task's {len(task)} prompts")
    console.print(f"loading model {args.model} ...", highlight=False)
    loaded = load_eval_model(args.model, args.dtype, _device(args.device), use_checkpoint=args.checkpoint)
    if args.threads:
        torch.set_num_threads(args.threads)
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    if not 1 <= args.top_logprobs <= vocab:
        raise ConfigError(
            f"--top-logprobs={args.top_logprobs} must be in [1, {vocab}] (the model's vocabulary)"
        )
    prompts, chosen = _prompts(args, task, loaded, indices)

    t0 = time.perf_counter()
    store = {"store_dir": out / UNITS_DIR, "resume": args.resume}
    with progress_bar(console) as progress:
        if args.schedule:
            report = check_schedule(
                loaded.model, loaded.tokenizer, prompts, args.schedule, settings, progress, **store
            )
        else:
            report = calibrate(loaded.model, loaded.tokenizer, prompts, budgets, settings, progress, **store)
    report["command"] = command_line(args)
    report["source"] = {"model": args.model, "model_loaded_from": loaded.path, "data": args.data,
                        "split": args.split, **chosen}  # fmt: skip
    report["wall_s"] = time.perf_counter() - t0
    report["goals"] = report_goals(report)
    for path in write_outputs(report, out):
        console.print(f"wrote {path}", highlight=False)
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    print_tail(report)
    if args.schedule:
        print(f"all bins {settings.tail} >= {settings.tau}: {report['all_pass']}")
    else:
        print(f"schedule (kv.schedule={out / SCHEDULE_JSON}): {report['schedule']}")
    return 0


def _prompts(args: argparse.Namespace, task, loaded, indices: list[int]) -> tuple[list[list[int]], dict]:
    """The calibration prompts (the task's rows `indices`, or with --lengths `--prompts` problems at each
    target length) and what they are, for the report's `source`; each leaves room for --max-new-tokens."""
    from sparserl.eval.calibrate_prompts import graded_length_prompts
    from sparserl.eval.evaluate import check_prompt_lengths
    from sparserl.models import encode_prompt

    if not args.lengths:
        prompt_ids = {i: encode_prompt(loaded.tokenizer, task[i].messages) for i in indices}
        check_prompt_lengths(loaded.model, task, indices, prompt_ids, args.max_new_tokens)
        return list(prompt_ids.values()), {"prompt_indices": indices}
    lengths = _int_list(args.lengths, "--lengths")
    try:
        prompts, described = graded_length_prompts(task, loaded.tokenizer, lengths, args.prompts, args.offset)
    except UserError as e:
        raise ConfigError(str(e)) from None
    limit = getattr(loaded.model.config, "max_position_embeddings", None) or float("inf")
    too_long = sorted({d["target"] for d in described if d["tokens"] + args.max_new_tokens > limit})
    if too_long:
        raise ConfigError(f"--lengths {too_long}: prompt + --max-new-tokens {args.max_new_tokens} pass the "
                          f"model's {limit} positions")  # fmt: skip
    return prompts, {"prompt_indices": indices, "graded_lengths": described}


@contextmanager
def progress_bar(console) -> Iterator[ProgressFn]:
    """A bar over the calibration's (KV policy, prompt) units with the time left, on the console's stream."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("calibrating", total=None)

        def advance(done: int, total: int, unit: str) -> None:
            bar.update(task, completed=done, total=total, description=f"calibrating ({unit})")

        yield advance


def print_tail(report: dict) -> None:
    """Each row's P5 per bin with its interval: `budget  bin0 0.91 [0.88, 0.93]  bin1 ...`."""
    for row in report["table"]:
        cells = [
            f"bin{b['index']} {b['p5']:.3f}"
            + (f" [{b['p5_low']:.3f}, {b['p5_high']:.3f}]" if b["p5_low"] is not None else "")
            for b in row["bins"]
            if b["p5"] is not None
        ]
        print(f"{row['label']:>8}  " + "  ".join(cells))
