"""Calibrating KV budgets by the tail of the acceptance rate (Sparrow, spec section 3; `sparserl calibrate`).

For each candidate budget, sample calibration prompts x n with that constant budget, take alpha of every token
against the dense policy (`engine.acceptance.measure_acceptance`), and pool it per bin of absolute position: the
P5 per (budget, bin) is the table. The schedule takes, per bin, the smallest budget whose P5 >= tau, then the
running maximum, so that it is non-decreasing; it is written in the format `kv.schedule` reads. `check_schedule`
measures the same per-bin tail with a schedule itself, on other (held-out) prompts. docs/calibration.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from sparserl.algo.acceptance import (
    BOOTSTRAP_RESAMPLES,
    INTERVAL_LEVEL,
    MIN_BIN_SEQUENCES,
    TOO_FEW_TOKENS,
    AcceptanceBin,
    check_tau,
)
from sparserl.engine.acceptance import TokenAcceptance, measure_acceptance
from sparserl.engine.kv_config import DENSE, KVConfig, kv_methods
from sparserl.engine.prefill_reuse import reusing_prefills
from sparserl.engine.schedule import parse_schedule
from sparserl.errors import UserError
from sparserl.eval.calibrate_store import UnitStore, fingerprint
from sparserl.eval.calibration_plot import plot_heatmap
from sparserl.eval.evaluate import write_json

DEFAULT_BIN_WIDTH = (
    512  # SmolLM2 has 8192 positions and CPU runs reach a few thousand: Sparrow's 2000 is too wide
)
DEFAULT_TAU = 0.86  # Sparrow's cheapest stable threshold
ESTIMATES = ("exact", "topk")  # which alpha the tail is read from (sparserl.algo.acceptance)
PASSES, NO_BUDGET_PASSES, RAISED = "passes", "no budget passes", "raised to stay non-decreasing"
CALIBRATION_JSON, HEATMAP_PNG, SCHEDULE_JSON = "calibration.json", "calibration.png", "schedule.json"
CHECK_JSON, CHECK_PNG = "check.json", "check.png"

ProgressFn = Callable[[int, int, str], None]  # (units done, units in all, the unit just finished)


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
    resamples: int = (
        BOOTSTRAP_RESAMPLES  # bootstrap draws of each P5's interval; 0: no interval, choose by P5
    )

    def __post_init__(self) -> None:
        sparse = [m for m in kv_methods() if m != DENSE]
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
        if self.resamples < 0:
            raise UserError(f"resamples={self.resamples} must be >= 0 (0: no interval; the schedule uses P5)")
        fixed = sorted({"method", "budget", "schedule"} & set(self.kv_options))
        if fixed:
            raise UserError(f"kv_options may not set {', '.join(fixed)}: the calibration sets them")
        KVConfig(method="dense", **self.kv_options)  # the options alone (a dense config checks no budget)

    def kv(self, **budget: Any) -> KVConfig:
        """The KV policy of this method with the options and `budget=` or `schedule=`."""
        return KVConfig(method=self.method, **self.kv_options, **budget)

    @property
    def tail(self) -> str:
        """The statistic a bin is judged by: the lower bound of P5's interval, or P5 without a bootstrap."""
        return "p5_low" if self.resamples else "p5"


def budget_grid(low: int, high: int, ratio: float, multiple: int) -> list[int]:
    """Candidate budgets from `low` to `high` (both kept, rounded up to multiples of `multiple`, block_topk's
    page size), each the last times `ratio` rounded to the nearest multiple (steps of 1.25-1.5x
    make a useful grid); a last step shorter than sqrt(ratio) is merged into `high`."""
    if not 1 < ratio <= 4 or multiple < 1 or not 0 < low <= high:
        raise UserError(f"budget grid {low}:{high}:{ratio}: need 0 < low <= high and 1 < ratio <= 4")
    grid, top = [-(-low // multiple) * multiple], -(-high // multiple) * multiple
    while (step := max(grid[-1] + multiple, round(grid[-1] * ratio / multiple) * multiple)) < top:
        grid.append(step)
    if len(grid) > 1 and top / grid[-1] < ratio**0.5:
        grid[-1] = top
    elif grid[-1] != top:
        grid.append(top)
    return grid


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


def measure_unit(
    model: nn.Module, tokenizer: Any, prompt: Sequence[int], kv: KVConfig, s: CalibrationSettings
) -> TokenAcceptance:
    """One unit of a calibration: sample the prompt n times under `kv` and take alpha of every token."""
    return measure_acceptance(
        model, tokenizer, [prompt], kv, s.n, s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.seed,
        s.top_logprobs, exact=s.estimate == "exact", samples_per_call=s.samples_per_call,
        ignore_eos=s.ignore_eos,
    )  # fmt: skip


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
    store_dir: str | Path | None,
    resume: bool,
) -> list[dict[str, Any]]:
    """The table's rows: per (label, KV policy), its bins padded to the longest row, and the wall time spent
    measuring it in this process. Prompt by prompt: a prompt's units share its prefills (engine/prefill_reuse.py;
    their time is charged to the first row that measures the prompt). With `store_dir`, every finished (policy,
    prompt) unit is kept there and, with `resume`, units already there are read instead of measured again."""
    store = UnitStore(store_dir, resume) if store_dir is not None else None
    parts: dict[str, list[TokenAcceptance]] = {label: [] for label, _ in rows}
    wall = dict.fromkeys(parts, 0.0)
    done, total = 0, len(rows) * len(prompt_ids)
    for p, prompt in enumerate(prompt_ids):
        with reusing_prefills():
            for label, kv in rows:
                t0 = time.perf_counter()
                digest = fingerprint(asdict(s), label, asdict(kv), list(prompt))
                alpha = store.load(label, p, digest) if store is not None else None
                if alpha is None:
                    alpha = measure_unit(model, tokenizer, prompt, kv, s)
                    if store is not None:
                        store.save(label, p, alpha, digest, next(model.parameters()).device.type)
                parts[label].append(alpha)
                wall[label] += time.perf_counter() - t0
                done += 1
                if progress is not None:
                    progress(done, total, f"{label}, prompt {p + 1}")
    measured = [
        (label, kv, TokenAcceptance.concatenated(parts[label]).binned(s.bin_width, s.tau, s.resamples)[s.estimate],
         wall[label])
        for label, kv in rows
    ]  # fmt: skip
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
        "judged_by": s.tail,
        "interval_level": INTERVAL_LEVEL if s.resamples else None,
        "warnings": _thin_cells(table),
    }


def _thin_cells(table: list[dict[str, Any]]) -> list[str]:
    """A warning when measured cells hold fewer than `MIN_BIN_SEQUENCES` sequences (their tail is noisy)."""
    counts = [b["sequences"] for row in table for b in row["bins"] if b["p5"] is not None]
    thin = [c for c in counts if c is not None and c < MIN_BIN_SEQUENCES]
    if not thin:
        return []
    return [f"{len(thin)} of {len(counts)} measured cells have fewer than {MIN_BIN_SEQUENCES} sequences (the "
            f"fewest: {min(thin)}): their P5 is noisy; sample more prompts or a larger n"]  # fmt: skip


def choose_schedule(
    budgets: Sequence[int], p5: Sequence[Sequence[float | None]], bin_width: int, tau: float
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """The schedule from a tail table (`p5[row][bin]`: P5 or the lower bound of its interval, rows in
    increasing budget order, None: too few tokens or sequences).

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
    store_dir: str | Path | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Measure the alpha tail per (budget, length bin) on `prompt_ids` x n and choose the schedule
    (`choose_schedule`, judged by `settings.tail`: the lower bound of P5's 90% interval by default). Returns the
    JSON-ready report: settings, the table (P5 and its interval, P1, mean, fraction below tau, tokens and
    sequences per cell), `schedule` (the kv.schedule table), `schedule_bins` and `warnings` (bins no budget
    passes, thin cells). Every budget is checked before any sampling. `store_dir`/`resume`: `_measure_rows`."""
    configs = candidate_kv_configs(settings, budgets)
    if not prompt_ids:
        raise UserError("no calibration prompts: give at least one")
    rows = [(str(kv.budget), kv) for kv in configs]
    table = _measure_rows(model, tokenizer, prompt_ids, rows, settings, progress, store_dir, resume)
    report = _report("calibration", settings, prompt_ids, table)
    tail = [[b[settings.tail] for b in row["bins"]] for row in report["table"]]
    schedule, records = choose_schedule([kv.budget for kv in configs], tail, settings.bin_width, settings.tau)
    report["schedule"], report["schedule_bins"] = schedule, records
    report["warnings"] += [
        f"bin {r['index']} (from length {r['from_length']}): no candidate budget reaches {settings.tail} >= "
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
    store_dir: str | Path | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """The held-out check: the alpha tail per length bin when sampling with `schedule` itself (a table, or a
    file `kv.schedule` reads) on `prompt_ids`, which should not be the calibration prompts. The report's
    `verdict` says per bin whether its tail (`settings.tail`: the lower bound of P5's interval by default) is
    >= tau; `all_pass` is true when every bin with enough tokens passes (bins with too few tokens are listed in
    `warnings`)."""
    kv = settings.kv(schedule=parse_schedule(schedule, "schedule", settings.method))
    if not prompt_ids:
        raise UserError("no held-out prompts: give at least one")
    table = _measure_rows(
        model, tokenizer, prompt_ids, [("schedule", kv)], settings, progress, store_dir, resume
    )
    report = _report("schedule_check", settings, prompt_ids, table)
    report["schedule"] = kv.schedule
    tail = settings.tail
    verdict = [
        {"index": b["index"], "p5": b["p5"], "p5_low": b["p5_low"], "p5_high": b["p5_high"],
         "passes": None if b[tail] is None else b[tail] >= settings.tau}
        for b in table[0]["bins"]
    ]  # fmt: skip
    report["verdict"] = verdict
    report["all_pass"] = all(v["passes"] is not False for v in verdict)
    report["warnings"] += [f"bin {v['index']}: {TOO_FEW_TOKENS}" for v in verdict if v["passes"] is None]
    return report


def report_goals(report: dict[str, Any]) -> dict[str, Any]:
    """The report's goal in the project's results format (value, target, met, command). A calibration: every
    length bin with enough tokens has a candidate budget whose tail (`judged_by`) >= tau (value: the share that
    has). A check: every such bin keeps its tail >= tau under the schedule on held-out prompts (value: the
    lowest; the calibration goal when judged by the interval's lower bound)."""
    tau, command = report["settings"]["tau"], report.get("command")
    tail = report.get("judged_by", "p5")
    what = "P5" if tail == "p5" else "P5 at the lower bound of its 90% interval"
    if report["kind"] == "calibration":
        measured = [r for r in report["schedule_bins"] if not r["reason"].startswith(TOO_FEW_TOKENS)]
        passing = [r for r in measured if not r["reason"].startswith(NO_BUDGET_PASSES)]
        share = len(passing) / len(measured) if measured else None
        name, value, target, met = (
            f"every measured bin has a budget with {what} >= tau",
            share,
            1.0,
            share == 1.0,
        )
    else:
        values = [v[tail] for v in report["verdict"] if v[tail] is not None]
        value = min(values) if values else None
        name, target, met = (
            f"held-out {what} >= tau in every measured bin",
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
