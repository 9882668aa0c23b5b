"""Calibrating KV budgets by the tail of the acceptance rate (Sparrow, spec section 3; `sparserl calibrate`).

For each candidate budget, sample calibration prompts x n with that constant budget, take alpha of every token
against the dense policy (`engine.acceptance.measure_acceptance`), and pool it per bin of absolute position: the
P5 per (budget, bin) is the table. The schedule takes, per bin, the smallest budget whose P5 >= tau, then the
running maximum, so that it is non-decreasing; it is written in the format `kv.schedule` reads. `check_schedule`
measures the same per-bin tail with a schedule itself, on other (held-out) prompts. docs/calibration.md.
"""

from __future__ import annotations

import argparse
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from sparserl.algo.acceptance import TOO_FEW_TOKENS, AcceptanceBin, check_tau
from sparserl.config import ConfigError
from sparserl.engine.acceptance import measure_acceptance
from sparserl.engine.kv_config import KV_METHODS, KVConfig
from sparserl.engine.schedule import parse_schedule
from sparserl.errors import UserError
from sparserl.eval.calibration_plot import plot_heatmap
from sparserl.eval.evaluate import write_json
from sparserl.signals import stoppable

DEFAULT_BIN_WIDTH = (
    512  # SmolLM2 has 8192 positions and CPU runs reach a few thousand: Sparrow's 2000 is too wide
)
DEFAULT_TAU = 0.86  # Sparrow's cheapest stable threshold
ESTIMATES = ("exact", "topk")  # which alpha the tail is read from (sparserl.algo.acceptance)
PASSES, NO_BUDGET_PASSES, RAISED = "passes", "no budget passes", "raised to stay non-decreasing"
CALIBRATION_JSON, HEATMAP_PNG, SCHEDULE_JSON = "calibration.json", "calibration.png", "schedule.json"
CHECK_JSON, CHECK_PNG = "check.json", "check.png"

ProgressFn = Callable[[str], None]


@dataclass
class CalibrationSettings:
    """How alpha is sampled and binned; checked on construction, so bad input fails before any model work."""

    method: str
    kv_options: dict[str, Any] = field(default_factory=dict)  # other KVConfig fields (page_size, window, ...)
    n: int = 8
    max_new_tokens: int = 1024
    bin_width: int = DEFAULT_BIN_WIDTH
    tau: float = DEFAULT_TAU
    estimate: str = "exact"
    top_logprobs: int = 20
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    ignore_eos: bool = False
    samples_per_call: int = 0

    def __post_init__(self) -> None:
        sparse = [m for m in KV_METHODS if m != "dense"]
        if self.method not in sparse:
            raise UserError(f"method={self.method!r} cannot be calibrated; choose one of {', '.join(sparse)}")
        check_tau(self.tau)
        if isinstance(self.bin_width, bool) or not isinstance(self.bin_width, int) or self.bin_width < 1:
            raise UserError(
                f"bin_width={self.bin_width!r} must be an integer >= 1 (tokens of position per bin)"
            )
        if self.estimate not in ESTIMATES:
            raise UserError(f"estimate={self.estimate!r} is unknown; choose one of {', '.join(ESTIMATES)}")
        for name in ("n", "max_new_tokens", "top_logprobs"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        if self.samples_per_call < 0:
            raise UserError(f"samples_per_call={self.samples_per_call} must be >= 0 (0: all n at once)")
        fixed = sorted({"method", "budget", "schedule"} & set(self.kv_options))
        if fixed:
            raise UserError(f"kv_options may not set {', '.join(fixed)}: the calibration sets them")
        KVConfig(method="dense", **self.kv_options)  # the options alone (a dense config checks no budget)

    def kv(self, **budget: Any) -> KVConfig:
        """The KV policy of this method with the options and `budget=` or `schedule=`."""
        return KVConfig(method=self.method, **self.kv_options, **budget)


def candidate_kv_configs(settings: CalibrationSettings, budgets: Sequence[int]) -> list[KVConfig]:
    """One KVConfig per candidate budget (sorted, duplicates dropped); an empty list or a budget the method
    refuses (eviction: not above the window; block_topk: not whole pages, or under 3 pages) is a UserError
    naming the budget."""
    if not budgets:
        raise UserError("budgets is empty: give at least one candidate budget, e.g. 64,128,256,512")
    configs = []
    for budget in sorted(set(budgets)):
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise UserError(f"candidate budget {budget!r} is not an integer")
        try:
            configs.append(settings.kv(budget=budget))
        except UserError as e:
            reason = str(e).replace(f"kv.budget={budget} ", "it ")
            raise UserError(f"candidate budget {budget} does not suit {settings.method}: {reason}") from None
    return configs


def measure_bins(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    kv: KVConfig,
    s: CalibrationSettings,
) -> list[AcceptanceBin]:
    """Sample every prompt n times under `kv` and bin the chosen alpha estimate of every token by position."""
    alpha = measure_acceptance(
        model, tokenizer, prompt_ids, kv, s.n, s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed,
        s.top_logprobs, exact=s.estimate == "exact", samples_per_call=s.samples_per_call,
        ignore_eos=s.ignore_eos,
    )  # fmt: skip
    return alpha.binned(s.bin_width, s.tau)[s.estimate]


def pad_bins(bins: list[AcceptanceBin], count: int, bin_width: int) -> list[AcceptanceBin]:
    """`bins` extended with empty ("too few tokens") bins up to `count`, so every row of a table is as long."""
    empty = [
        AcceptanceBin(i, i * bin_width, (i + 1) * bin_width, 0, note=TOO_FEW_TOKENS)
        for i in range(len(bins), count)
    ]
    return bins + empty


def _measure_rows(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    rows: list[tuple[str, KVConfig]],
    s: CalibrationSettings,
    progress: ProgressFn | None,
) -> list[dict[str, Any]]:
    """The table's rows: per (label, KV policy), its bins padded to the longest row, and its wall time."""
    measured = []
    for label, kv in rows:
        t0 = time.perf_counter()
        bins = measure_bins(model, tokenizer, prompt_ids, kv, s)
        measured.append((label, kv, bins, time.perf_counter() - t0))
        if progress is not None:
            progress(f"{label}: {sum(b.tokens for b in bins)} tokens in {measured[-1][3]:.1f}s")
    count = max((len(bins) for _, _, bins, _ in measured), default=0)
    return [
        {
            "label": label,
            "budget": kv.budget if kv.schedule is None else None,
            "wall_s": wall,
            "bins": [b.to_dict() for b in pad_bins(bins, count, s.bin_width)],
        }
        for label, kv, bins, wall in measured
    ]


def _report(kind: str, s: CalibrationSettings, prompt_ids: Sequence[Sequence[int]], table: list) -> dict:
    """The fields every report has: what was measured, with which settings, and the table."""
    width = s.bin_width
    count = len(table[0]["bins"]) if table else 0
    return {
        "kind": kind,
        "command": "",
        "settings": asdict(s),
        "prompts": len(prompt_ids),
        "prompt_tokens": [len(p) for p in prompt_ids],
        "bins": [{"index": i, "start": i * width, "end": (i + 1) * width} for i in range(count)],
        "table": table,
        "warnings": [],
    }


def choose_schedule(
    budgets: Sequence[int], p5: Sequence[Sequence[float | None]], bin_width: int, tau: float
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The schedule from a P5 table (`p5[row][bin]`, rows in increasing budget order, None: too few tokens).

    Per bin: the smallest budget with P5 >= tau ("passes"); none passing: the largest budget, flagged ("no
    budget passes"); no budget with enough tokens: the previous bin's budget (leading such bins: the first
    measured bin's). Then the running maximum makes it non-decreasing ("raised ..."). Returns the table
    [[from_length, budget], ...] and one record per bin saying how its budget was chosen.
    """
    check_tau(tau)
    if not budgets or list(budgets) != sorted(set(budgets)) or len(p5) != len(budgets):
        raise ValueError(f"choose_schedule: need one P5 row per budget, budgets increasing; got {budgets}")
    bins = len(p5[0]) if p5 else 0
    chosen: list[int | None] = []
    reasons = []
    for c in range(bins):
        column = [row[c] for row in p5]
        passing = [b for b, v in zip(budgets, column, strict=True) if v is not None and v >= tau]
        if passing:
            chosen.append(passing[0])
            reasons.append(PASSES)
        elif any(v is not None for v in column):
            chosen.append(budgets[-1])
            reasons.append(NO_BUDGET_PASSES)
        else:
            reasons.append(f"{TOO_FEW_TOKENS}: the {'previous' if chosen else 'first measured'} bin's budget")
            chosen.append(chosen[-1] if chosen else None)
    measured = [b for b in chosen if b is not None]
    if not measured:
        raise UserError(
            "no length bin has enough tokens (>= 20) under any budget: sample more (n, prompts, "
            "max_new_tokens) or widen the bins"
        )
    table, records, running = [], [], 0
    for c, (budget, reason) in enumerate(zip(chosen, reasons, strict=True)):
        budget = measured[0] if budget is None else budget
        running = max(running, budget)
        table.append([c * bin_width, running])
        records.append(
            {
                "index": c,
                "from_length": c * bin_width,
                "budget": running,
                "chosen": budget,
                "reason": reason if running == budget else f"{reason}; {RAISED}",
            }
        )
    return table, records


def calibrate(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    budgets: Sequence[int],
    settings: CalibrationSettings,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Measure the alpha tail per (budget, length bin) on `prompt_ids` x n and choose the schedule
    (`choose_schedule`). Returns the JSON-ready report: settings, the table (P5, P1, mean, fraction below tau,
    tokens per cell), `schedule` (the kv.schedule table), `schedule_bins` and `warnings` (bins no budget
    passes). Every budget is checked before any sampling."""
    configs = candidate_kv_configs(settings, budgets)
    if not prompt_ids:
        raise UserError("no calibration prompts: give at least one")
    rows = [(str(kv.budget), kv) for kv in configs]
    table = _measure_rows(model, tokenizer, prompt_ids, rows, settings, progress)
    report = _report("calibration", settings, prompt_ids, table)
    p5 = [[b["p5"] for b in row["bins"]] for row in report["table"]]
    schedule, records = choose_schedule([kv.budget for kv in configs], p5, settings.bin_width, settings.tau)
    report["schedule"], report["schedule_bins"] = schedule, records
    report["warnings"] = [
        f"bin {r['index']} (from length {r['from_length']}): no candidate budget reaches P5 >= "
        f"{settings.tau}; it gets the largest, {r['chosen']}"
        for r in records
        if r["reason"].startswith(NO_BUDGET_PASSES)
    ]
    return report


def check_schedule(
    model: nn.Module,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    schedule: Any,
    settings: CalibrationSettings,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """The held-out check: the alpha tail per length bin when sampling with `schedule` itself (a table, or a
    file `kv.schedule` reads) on `prompt_ids`, which should not be the calibration prompts. The report's
    `verdict` says per bin whether P5 >= tau; `all_pass` is true when every bin with enough tokens passes
    (bins with too few tokens are listed in `warnings`)."""
    kv = settings.kv(schedule=parse_schedule(schedule, "schedule", settings.method))
    if not prompt_ids:
        raise UserError("no held-out prompts: give at least one")
    table = _measure_rows(model, tokenizer, prompt_ids, [("schedule", kv)], settings, progress)
    report = _report("schedule_check", settings, prompt_ids, table)
    report["schedule"] = kv.schedule
    verdict = [
        {"index": b["index"], "p5": b["p5"], "passes": None if b["p5"] is None else b["p5"] >= settings.tau}
        for b in table[0]["bins"]
    ]
    report["verdict"] = verdict
    report["all_pass"] = all(v["passes"] is not False for v in verdict)
    report["warnings"] = [f"bin {v['index']}: {TOO_FEW_TOKENS}" for v in verdict if v["passes"] is None]
    return report


def report_goals(report: dict[str, Any]) -> dict[str, Any]:
    """The report's goal in the project's results format (value, target, met, command). A calibration: every
    length bin with enough tokens has a candidate budget whose P5 >= tau (value: the share that has). A check:
    every such bin keeps P5 >= tau under the schedule on held-out prompts (value: the lowest P5; issue 15's
    Tail goal)."""
    tau, command = report["settings"]["tau"], report.get("command")
    if report["kind"] == "calibration":
        measured = [r for r in report["schedule_bins"] if not r["reason"].startswith(TOO_FEW_TOKENS)]
        passing = [r for r in measured if not r["reason"].startswith(NO_BUDGET_PASSES)]
        share = len(passing) / len(measured) if measured else None
        name, value, target, met = "every measured bin has a budget with P5 >= tau", share, 1.0, share == 1.0
    else:
        p5 = [v["p5"] for v in report["verdict"] if v["p5"] is not None]
        value = min(p5) if p5 else None
        name, target, met = (
            "held-out P5 >= tau in every measured bin",
            tau,
            value is not None and value >= tau,
        )
    return {name: {"value": value, "target": target, "met": met, "command": command}}


def write_outputs(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write a calibration's JSON, heatmap and schedule file (or a check's JSON and heatmap) into `out_dir`.
    The schedule file is a mapping whose `schedule` key holds the table, which `kv.schedule=FILE` reads; the
    other keys record what it was calibrated for."""
    out = Path(out_dir)
    if report["kind"] != "calibration":
        return [write_json(report, out / CHECK_JSON), plot_heatmap(report, out / CHECK_PNG)]
    s = report["settings"]
    schedule = {
        "schedule": report["schedule"],
        "method": s["method"],
        "kv_options": s["kv_options"],
        "tau": s["tau"],
        "estimate": s["estimate"],
        "bin_width": s["bin_width"],
        "calibration": CALIBRATION_JSON,
        "goals": report.get("goals", {}),
    }
    return [
        write_json(report, out / CALIBRATION_JSON),
        plot_heatmap(report, out / HEATMAP_PNG),
        write_json(schedule, out / SCHEDULE_JSON),
    ]


# ---------------------------------------------------------------------------------------------- command


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
                args.samples_per_call,
            )  # fmt: skip
            if args.schedule:
                settings.kv(schedule=parse_schedule(args.schedule, "--schedule", args.method))
                return settings, []
            budgets = _int_list(args.budgets, "--budgets")
            candidate_kv_configs(settings, budgets)
            return settings, budgets
    except UserError as e:
        raise ConfigError(str(e)) from None


@stoppable("sparserl calibrate", "its outputs were not written (or not all); run the same command again")
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
    from sparserl.eval.evaluate import check_prompt_lengths
    from sparserl.eval.loading import load_eval_model, load_eval_task
    from sparserl.models import encode_prompt

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
    prompt_ids = {i: encode_prompt(loaded.tokenizer, task[i].messages) for i in indices}
    check_prompt_lengths(loaded.model, task, indices, prompt_ids, args.max_new_tokens)
    prompts = list(prompt_ids.values())

    def progress(message: str) -> None:
        console.print(f"  {message}", highlight=False)

    t0 = time.perf_counter()
    if args.schedule:
        report = check_schedule(loaded.model, loaded.tokenizer, prompts, args.schedule, settings, progress)
    else:
        report = calibrate(loaded.model, loaded.tokenizer, prompts, budgets, settings, progress)
    report["command"] = command_line(args)
    report["source"] = {"model": args.model, "model_loaded_from": loaded.path, "data": args.data,
                        "split": args.split, "prompt_indices": indices}  # fmt: skip
    report["wall_s"] = time.perf_counter() - t0
    report["goals"] = report_goals(report)
    for path in write_outputs(report, out):
        console.print(f"wrote {path}", highlight=False)
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    if args.schedule:
        print(f"all bins P5 >= {settings.tau}: {report['all_pass']}")
    else:
        print(f"schedule (kv.schedule={out / SCHEDULE_JSON}): {report['schedule']}")
    return 0
