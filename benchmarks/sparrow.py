"""Sparrow rollouts: dense vs block-sparse attention (`block_topk`) with a calibrated schedule and at a
fixed budget, and R-KV with a calibrated schedule: speed, positions read and held, alpha's tail, cost model.

One short chat prompt (the one benchmarks/sparse_rollout.py uses; not a calibration prompt), `--batch` samples
of it, temperature 1, EOS ignored, fp32, `--threads` torch threads (1: two processes can fill the grid side by
side on two cores). Lengths: 4096 new tokens and `max`, as many as the model's context allows (SmolLM2: 8192
positions minus the prompt). Per arm and length it reports:

- tokens per CPU second and per wall second of one `generate` call (prefill + decode; model load and a short
  warm-up excluded), the positions read per step (mean, peak) and held (the engine's position statistics);
- for the sparse arms, the exact alpha_t = sum_v min(p_sparse, p_dense) of every token of `--alpha-samples`
  further samples of the same prompt (`eval.acceptance.measure_acceptance`, one sample per call so that one
  sample's full distributions, 4 bytes x 49,152 ids per token, are held at a time), pooled per `--bin-width`
  bin of absolute position: P5, P1, mean, fraction below tau (the batch-16 run records no distributions: they
  would take 16 x 8k x 196 KB = 25 GB);
- the cost model's predicted speed-up over dense (`sparserl.cost.estimate`, I = `--intensity`) next to the
  measured one per CPU second.

    python benchmarks/sparrow.py                                   # every arm at 4096 and max: many hours
    python benchmarks/sparrow.py --resume --arms dense --lengths max     # one cell; run cells side by side
    python benchmarks/sparrow.py --quick                           # a smoke run of a few minutes, temp file

Every process writes its runs into the same JSON under a lock (re-read, merged, replaced atomically);
`--resume` keeps the runs already there (same settings) and skips the (arm, length) cells done with the same
KV policy; a cell whose speed run is there but whose alpha is not gets only its alpha measured.
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    REPO,
    RESULTS,
    command_line,
    machine_info,
    measure,
    merge_runs_and_write,
    mib,
    print_table,
    runs_with_settings,
    timed_rollout,
)
from sparse_rollout import PROMPT

from sparserl.cost import INTENSITY_PRESETS, Rollout, estimate, resolve_intensity, shape_from_config
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.schedule import parse_schedule
from sparserl.errors import UserError
from sparserl.eval.acceptance import measure_acceptance
from sparserl.eval.calibrate import DEFAULT_BIN_WIDTH, DEFAULT_TAU
from sparserl.models import encode_prompt, load_model

DEFAULT_SCHEDULE = RESULTS / "calibration" / "schedule.json"
FULL = {"batch": 16, "lengths": "4096,max", "budget": 512, "bin_width": DEFAULT_BIN_WIDTH}
QUICK = {"batch": 2, "lengths": "64,128", "budget": 64, "bin_width": 64}
QUICK_OUT = Path(tempfile.gettempdir()) / "sparrow_quick.json"
GOALS = {"speedup_min": 2.0, "model_error_max": 0.20}  # the tail goal's target is --tau


class SkipArm(Exception):
    """An arm that cannot run with the given flags (the message says why); the others go on."""


def schedule_kv(path: str, method: str, flag: str) -> KVConfig:
    """A KV policy from a schedule file written by `sparserl calibrate`: its table, and its `kv_options` (page
    size, dense layers, window, ...) so that the schedule is used as it was calibrated."""
    table = parse_schedule(path, key=flag)  # a missing or malformed file is a UserError naming flag and file
    raw = yaml.safe_load(Path(path).read_text())
    raw = raw if isinstance(raw, dict) else {}
    calibrated = raw.get("method", method)
    if calibrated != method:
        raise UserError(f"{flag} {path}: calibrated for method {calibrated!r}; this arm runs {method!r}")
    try:
        return KVConfig(method=method, schedule=table, **raw.get("kv_options", {}))
    except TypeError as err:
        raise UserError(f"{flag} {path}: kv_options {raw.get('kv_options')} is not a set of kv keys") from err


def rkv_schedule_kv(args: argparse.Namespace) -> KVConfig:
    if args.rkv_schedule is None:
        raise SkipArm(
            "rkv_schedule: no --rkv-schedule file given, so the arm is skipped (make one with `sparserl "
            "calibrate --method rkv --budgets ... --ignore-eos`; this benchmark does not invent a schedule)"
        )
    return schedule_kv(args.rkv_schedule, "rkv", "--rkv-schedule")


@dataclass(frozen=True)
class Arm:
    """One benchmark arm: its KV policy from the command line (None: the dense cache)."""

    help: str
    kv: Callable[[argparse.Namespace], KVConfig | None]


ARMS = {
    "dense": Arm("every position held and read", lambda args: None),
    "block_topk_schedule": Arm(
        "block_topk with the tau schedule of --schedule",
        lambda args: schedule_kv(args.schedule, "block_topk", "--schedule"),
    ),
    "block_topk_fixed": Arm(
        "block_topk at --budget", lambda args: KVConfig(method="block_topk", budget=args.budget)
    ),
    "rkv_schedule": Arm("R-KV eviction with the schedule of --rkv-schedule", rkv_schedule_kv),
}
SPEED_ARM = "block_topk_schedule"  # the arm the goals are about


def parse_choices(spec: str, choices, flag: str) -> list[str]:
    items = [x for x in spec.split(",") if x]
    unknown = [x for x in items if x not in choices]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"{flag}: {unknown or 'empty'}; choose from {', '.join(choices)}")
    return items


def parse_lengths(spec: str) -> list[str]:
    items = [x for x in spec.split(",") if x]
    if not items or any(x != "max" and not (x.isdigit() and int(x) > 0) for x in items):
        raise argparse.ArgumentTypeError(f"--lengths {spec!r}: comma-separated positive integers or 'max'")
    return items


def resolve_lengths(spec: list[str], context: int, prompt_len: int) -> list[int]:
    """'max' is as many new tokens as the model's context leaves after the prompt."""
    lengths = [context - prompt_len if x == "max" else int(x) for x in spec]
    over = [n for n in lengths if prompt_len + n > context]
    if over:
        raise UserError(
            f"--lengths {over[0]}: {prompt_len} prompt tokens + {over[0]} > the {context}-position context"
        )
    return lengths


def run_speed(
    model, tokenizer, kv: KVConfig | None, prompt: list[int], batch: int, length: int, seed: int
) -> dict:
    """One `generate` of `batch` samples x `length` tokens: CPU and wall time, positions read and held."""
    out, timing = timed_rollout(model, tokenizer, kv, prompt, batch, length, seed)
    kept = ("prefill_s", "decode_s", "read_positions_mean", "read_positions_peak", "held_positions_mean",
            "peak_kv_positions", "peak_kv_bytes", "kv_bytes_per_position")  # fmt: skip
    return {
        **timing, "tokens_per_s": batch * length / timing["wall_s"], **{key: out.stats[key] for key in kept},
        "decode_step_s": out.stats["decode_s"] / max(length - 1, 1),
    }  # fmt: skip


def run_alpha(model, tokenizer, kv: KVConfig, prompt: list[int], length: int, args) -> dict:
    """Exact alpha of `--alpha-samples` samples (one per call, seeds seed, seed + 1, ...) per position bin."""
    cpu0 = time.process_time()
    with measure() as m:
        alpha = measure_acceptance(
            model, tokenizer, [prompt], kv, args.alpha_samples, length, seed=args.seed, exact=True,
            samples_per_call=1, ignore_eos=True,
        )  # fmt: skip
    bins = [b.to_dict() for b in alpha.binned(args.bin_width, args.tau)["exact"]]
    p5 = [b["p5"] for b in bins if b["p5"] is not None]
    return {
        "samples": args.alpha_samples, "tokens": int(alpha.positions.numel()),
        "cpu_s": time.process_time() - cpu0, "wall_s": m["seconds"], "peak_rss_mib": mib(m["peak_rss_bytes"]),
        "min_p5": min(p5, default=None), "bins": bins, "command": command_line(),
    }  # fmt: skip


def schedule_provenance(path: str) -> dict:
    """What the schedule was calibrated on (prompts, positions reached), read from the calibration.json its
    schedule file names, and which budget holds beyond the calibrated positions."""
    if not Path(path).is_file():
        return {"schedule_file": path, "note": "not found"}
    raw = yaml.safe_load(Path(path).read_text())
    table = parse_schedule(path, key="--schedule")
    out = {"schedule_file": path, "schedule": table}
    calibration = Path(path).parent / raw.get("calibration", "calibration.json")
    if not calibration.is_file():
        out["note"] = f"{calibration} not found: the calibrated range is unknown"
        return out
    cal = json.loads(calibration.read_text())
    reached = max(cal["prompt_tokens"]) + cal["settings"]["max_new_tokens"]
    start, budget = table[-1]
    out |= {
        "calibration_prompts": cal.get("source"),
        "calibrated_positions": [min(cal["prompt_tokens"]), reached],
        "note": f"calibrated on positions up to {reached}; the last bin (budget {budget} from length "
        f"{start}) holds for every longer length, so beyond {reached} the schedule is an extrapolation",
    }
    return out


def predicted_ratios(shape, prompt_len: int, batch: int, length: int, kv: KVConfig, intensity: float) -> dict:
    """The cost model's speed-up of `kv` over dense for this rollout (whole call, and decode only), and its
    cap: dense over the weights' cost alone, which no KV method can beat."""
    rollout = Rollout(prompt_len, length, batch)
    dense, sparse = estimate(shape, rollout, KVConfig()), estimate(shape, rollout, kv)
    weights = dense.total.weight_flops + intensity * dense.total.weight_bytes
    return {
        "predicted_speedup": dense.total.effective(intensity) / sparse.total.effective(intensity),
        "predicted_decode_speedup": dense.decode.effective(intensity) / sparse.decode.effective(intensity),
        "weight_cap": dense.total.effective(intensity) / weights,
    }


def summarise(runs: list[dict], model, prompt_len: int, args) -> list[dict]:
    """Per run: measured ratios against the dense run of the same length, and the cost model's."""
    dense = {r["length"]: r for r in runs if r["arm"] == "dense"}
    shape = shape_from_config(model.config, args.model)
    rows = []
    for r in runs:
        row = {k: v for k, v in r.items() if k not in ("alpha", "kv")}
        row["alpha_min_p5"] = (r.get("alpha") or {}).get("min_p5")
        d = dense.get(r["length"])
        if r["arm"] != "dense":
            kv = KVConfig(**r["kv"])
            row |= predicted_ratios(shape, prompt_len, args.batch, r["length"], kv, args.intensity)
        if r["arm"] != "dense" and d is not None:
            row["cpu_speedup"] = r["tokens_per_cpu_s"] / d["tokens_per_cpu_s"]
            row["wall_speedup"] = r["tokens_per_s"] / d["tokens_per_s"]
            row["model_error"] = row["predicted_speedup"] / row["cpu_speedup"] - 1
        rows.append(row)
    return rows


def goal(value: float | None, target: float, met: bool, command: str, **detail) -> dict:
    """One entry of the top-level `goals` mapping."""
    return {"value": value, "target": target, "met": met, **detail, "command": command}


def missing_goal(target: float, reason: str, arms: str) -> dict:
    """A goal whose runs are not there yet: no value, not met, why, and the command that measures it."""
    return goal(None, target, False, f"python benchmarks/sparrow.py --resume --arms {arms} --lengths max",
                reason=reason)  # fmt: skip


def goals_report(runs: list[dict], summary: list[dict], length: int, tau: float, provenance: dict) -> dict:
    """The issue's goals: speed (>= 2x dense per CPU second, the cost model within 20%) at the longest length,
    and the tail (every bin's P5 >= tau under the calibrated schedule, on this held-out prompt)."""
    at = {(r["arm"], r["length"]): r for r in summary}
    cell, base, new = at.get((SPEED_ARM, length)), at.get(("dense", length)), f"{length} new tokens"
    speed = f"Speed: {SPEED_ARM} >= {GOALS['speedup_min']:g}x dense tokens per CPU second at {new}"
    model = f"Speed: the cost model predicts the measured {SPEED_ARM} / dense ratio within 20% at {new}"
    tail = f"Tail: every bin's P5 under the calibrated schedule >= {tau:g} on a held-out prompt"
    if cell is None or base is None:
        why, arms = f"no {SPEED_ARM} run and dense run both at {new} yet", f"dense,{SPEED_ARM}"
        goals = {speed: missing_goal(GOALS["speedup_min"], why, arms),
                 model: missing_goal(GOALS["model_error_max"], why, arms)}  # fmt: skip
    else:
        command = "; ".join(dict.fromkeys([base["command"], cell["command"]]))
        ratio, error = cell["cpu_speedup"], abs(cell["model_error"])
        goals = {
            speed: goal(ratio, GOALS["speedup_min"], ratio >= GOALS["speedup_min"], command,
                        wall_clock_value=cell["wall_speedup"], cost_model_weight_cap=cell["weight_cap"],
                        note="cost_model_weight_cap: dense over the weights' cost alone at this batch; no KV "
                        "method can exceed it on this CPU"),
            model: goal(error, GOALS["model_error_max"], error <= GOALS["model_error_max"], command,
                        predicted=cell["predicted_speedup"], measured=ratio),
        }  # fmt: skip
    measured = sorted(
        (r for r in runs if r["arm"] == SPEED_ARM and r.get("alpha")), key=lambda r: r["length"]
    )
    bins = [dict(b, length=r["length"]) for r in measured for b in r["alpha"]["bins"] if b["p5"] is not None]
    if not bins:
        goals[tail] = missing_goal(tau, f"no {SPEED_ARM} run with alpha yet", SPEED_ARM)
        return goals
    worst = min(b["p5"] for b in bins)
    goals[tail] = goal(
        worst, tau, worst >= tau, "; ".join(dict.fromkeys(r["alpha"]["command"] for r in measured)),
        per_bin=[{k: b[k] for k in ("length", "start", "end", "tokens", "p5")} for b in bins],
        held_out_prompt=PROMPT, **provenance,
    )  # fmt: skip
    return goals


def print_report(summary: list[dict]) -> None:
    table = [
        [r["length"], r["arm"], r["tokens_per_cpu_s"], r.get("cpu_speedup", ""),
         r.get("predicted_speedup", ""), r["tokens_per_s"], r["read_positions_mean"],
         r["read_positions_peak"], r["held_positions_mean"], r["alpha_min_p5"] or ""]
        for r in sorted(summary, key=lambda r: (r["length"], list(ARMS).index(r["arm"])))
    ]  # fmt: skip
    print_table(["length", "arm", "tok/CPU-s", "x dense (CPU)", "x dense (model)", "tok/s", "read mean",
                 "read peak", "held mean", "min P5"], table)  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; flags left out take the full run's defaults, or with --quick the smoke run's."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--batch", type=int, help="samples of the prompt per call (default 16)")
    ap.add_argument("--lengths", type=parse_lengths, help="new tokens per sample, comma-separated; 'max' "
                    f"fills the context (default {FULL['lengths']})")  # fmt: skip
    ap.add_argument(
        "--arms",
        type=lambda s: parse_choices(s, ARMS, "--arms"),
        default=list(ARMS),
        help="; ".join(f"{k}: {arm.help}" for k, arm in ARMS.items()) + " (default all)",
    )
    ap.add_argument(
        "--schedule",
        default=str(DEFAULT_SCHEDULE.relative_to(REPO)),
        help="block_topk schedule file of `sparserl calibrate` (default %(default)s)",
    )
    ap.add_argument("--budget", type=int, help="block_topk_fixed: positions read per step (default 512)")
    ap.add_argument("--rkv-schedule", help="R-KV schedule file from `sparserl calibrate` (without it the "
                    "rkv_schedule arm is skipped)")  # fmt: skip
    ap.add_argument("--alpha-samples", type=int, default=2, help="samples per sparse cell whose exact alpha "
                    "is measured, one at a time (0: none)")  # fmt: skip
    ap.add_argument("--bin-width", type=int, help=f"positions per alpha bin (default {FULL['bin_width']})")
    ap.add_argument("--tau", type=float, default=DEFAULT_TAU, help="alpha threshold of the tail goal")
    ap.add_argument("--intensity", type=resolve_intensity, default=INTENSITY_PRESETS["cpu-1t"],
                    help="the cost model's FLOPs per byte: a number or a preset (cpu-1t)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: batch 2, lengths 64,128, budget 64, "
                    f"bins of 64, written to {QUICK_OUT}")  # fmt: skip
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out (same settings)")
    ap.add_argument("--redo", action="store_true", help="with --resume: run the given arms x lengths again")
    ap.add_argument("--out", type=Path, help=f"JSON output (default {RESULTS / 'sparrow.json'})")
    args = ap.parse_args(argv)
    args.grid = parse_lengths((QUICK if args.quick else FULL)["lengths"])  # the cells a complete file has
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, parse_lengths(value) if key == "lengths" else value)
    args.out = args.out or (QUICK_OUT if args.quick else RESULTS / "sparrow.json")
    if args.batch < 1 or args.alpha_samples < 0 or args.threads < 1:
        ap.error("--batch and --threads must be >= 1, --alpha-samples >= 0")
    return args


def plan(lengths: list[int], arms: dict[str, KVConfig | None], on_disk: dict, args) -> list[tuple]:
    """The cells to measure, as (arm, length, kv, the run on disk whose speed is kept, or None to measure it):
    a cell runs unless a run with the same KV policy is on disk (or --redo); a sparse cell on disk without its
    alpha gets only its alpha."""
    todo = []
    for length in lengths:
        for name, kv in arms.items():
            old = on_disk.get((name, length))
            fresh = old is None or args.redo or old["kv"] != (kv and asdict(kv))
            alpha_due = kv is not None and args.alpha_samples > 0 and (fresh or not old.get("alpha"))
            if fresh or alpha_due:
                todo.append((name, length, kv, None if fresh else old))
    return todo


@dataclass
class Bench:
    """What every write of the report needs: the loaded model, the prompt, the settings."""

    args: argparse.Namespace
    model: object
    tokenizer: object
    prompt: list[int]
    settings: dict
    grid: list[int]
    load_s: float

    def build(self, runs: list[dict]) -> dict:
        """The report: runs, their summary against dense and the cost model, the goals."""
        args, provenance = self.args, schedule_provenance(self.args.schedule)
        summary = summarise(runs, self.model, len(self.prompt), args)
        done = {(r["arm"], r["length"]) for r in runs if r["arm"] == "dense" or r.get("alpha")}
        commands = [c for r in runs for c in (r["command"], (r.get("alpha") or {}).get("command")) if c]
        return {
            "benchmark": "Sparrow rollouts: dense vs block_topk (calibrated schedule, fixed budget) vs R-KV "
            "(calibrated schedule), sparserl RolloutEngine",
            "command": command_line(),
            "commands": [*dict.fromkeys(commands)],
            "missing": [[a, n] for n in self.grid for a in ARMS if (a, n) not in done],
            "settings": self.settings,
            "dtype": "float32",
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "eos": "ignored"},
            "positions_note": "read_positions_mean/peak: positions one sparse layer's KV head attends to per "
            "decode step (block_topk's dense layers read all); held_positions_mean: positions a sequence "
            "holds",
            "alpha_method": f"exact alpha of {args.alpha_samples} extra samples per sparse cell, one per "
            "call (seeds seed, seed + 1, ...), with the cell's KV policy, scored by the dense model on the "
            f"same prefixes; P5 per {args.bin_width}-position bin (eval.acceptance.measure_acceptance)",
            "schedule": provenance,
            "goals": goals_report(runs, summary, max(self.grid), args.tau, provenance),
            "goal_thresholds": GOALS,
            "model_load_s": self.load_s,
            "machine": machine_info(),
            "runs": runs,
            "summary": summary,
        }  # fmt: skip

    def write(self, mine: list[dict]) -> dict:
        return merge_runs_and_write(
            self.args.out, self.settings, mine, ("arm", "length"), self.args.resume, self.build
        )


def load(args: argparse.Namespace) -> Bench:
    """Load the model and encode the prompt; the settings every merged run must share."""
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": PROMPT}])
    context = RolloutEngine(model, tokenizer).decoder.max_positions
    args.lengths = resolve_lengths(args.lengths, context, len(prompt))
    settings = {"model": args.model, "batch": args.batch, "prompt": PROMPT, "prompt_tokens": len(prompt),
                "context": context, "threads": args.threads, "seed": args.seed,
                "alpha_samples": args.alpha_samples, "bin_width": args.bin_width, "tau": args.tau,
                "intensity": args.intensity}  # fmt: skip
    grid = resolve_lengths(args.grid, context, len(prompt))
    return Bench(args, model, tokenizer, prompt, settings, grid, load_s)


def measure_cells(bench: Bench, arms: dict[str, KVConfig | None], todo: list[tuple]) -> list[dict]:
    """Per length, the arms' speed runs one after another (so that they see the same machine), then their
    alpha; the report is written after each."""
    args, model, tokenizer, prompt = bench.args, bench.model, bench.tokenizer, bench.prompt
    mine: list[dict] = []
    for name in dict.fromkeys(name for name, *_ in todo):  # warm-up: first kernels and each arm's code path
        run_speed(model, tokenizer, arms[name], prompt, 2, 24, args.seed)
    for length in args.lengths:
        cells = [cell for cell in todo if cell[1] == length]
        for name, _, kv, old in cells:
            if old is None:
                res = run_speed(model, tokenizer, kv, prompt, args.batch, length, args.seed)
                old = {"arm": name, "length": length, "kv": kv and asdict(kv), "command": command_line()}
                old |= res
                print(f"{name:>19} {length:>5}: {res['tokens_per_cpu_s']:.2f} tok/CPU-s, read "
                      f"{res['read_positions_mean']:.0f} / held {res['held_positions_mean']:.0f} "
                      f"(load {res['load_avg_1min_before']:.1f})", flush=True)  # fmt: skip
            mine.append(dict(old))
            bench.write(mine)
        for run, (_, _, kv, _) in zip(mine[len(mine) - len(cells) :], cells, strict=True):
            if kv is not None and args.alpha_samples > 0:
                run["alpha"] = alpha = run_alpha(model, tokenizer, kv, prompt, length, args)
                print(f"{run['arm']:>19} {length:>5}: alpha P5 min {alpha['min_p5']} over {alpha['tokens']} "
                      f"tokens, {alpha['cpu_s']:.0f} CPU-s", flush=True)  # fmt: skip
                bench.write(mine)
    return mine


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    arms: dict[str, KVConfig | None] = {}
    for name in args.arms:
        try:
            arms[name] = ARMS[name].kv(args)
        except SkipArm as skip:
            print(f"skipping {skip}", flush=True)
    if not arms:
        raise UserError(f"--arms {','.join(args.arms)}: no arm left to run")
    bench = load(args)
    kept = runs_with_settings(args.out, bench.settings) if args.resume else []  # the file is replaced whole
    on_disk = {(r["arm"], r["length"]): r for r in kept}
    if args.resume:
        print(f"resuming: {len(on_disk)} runs kept from {args.out}", flush=True)
    mine = measure_cells(bench, arms, plan(args.lengths, arms, on_disk, args))
    final = bench.write(mine) if mine or not args.out.is_file() else json.loads(args.out.read_text())
    print_report(final["summary"])
    for name, entry in final["goals"].items():
        print(f"{'MET' if entry['met'] else 'not met'}: {name}: {entry['value']}")
    print(f"{'wrote' if mine else 'nothing to measure; read'} {args.out}")
    return final


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        sys.exit(f"error: {err}")
