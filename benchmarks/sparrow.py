"""Sparrow rollouts: dense vs block-sparse attention (`block_topk`) with a calibrated schedule and at a
fixed budget, and R-KV with a calibrated schedule: speed at a context, positions read and held, alpha's tail,
cost model. fp32, `--threads` torch threads (1: two processes can run side by side on two cores).

Two parts, run together or apart (`--parts`), written into one JSON:

- **speed**, per arm and context C (`--contexts`: 4096 and `max`, the model's whole context, 8192 positions
  for SmolLM2): `--batch` samples decode `--window` steps after a shared prefill of C - window positions
  (random token ids, as `sparserl cost --probe-decode` does: the step cost of these methods does not depend on
  what the tokens say), so the steps clocked are those at contexts C - window + 2 ... C - 1. Clocked between the
  engine's step callbacks (`sparserl.cost.probe.time_decode_steps`), so the prefill is left out. Arms alternate,
  `--repeats` times; medians. Reported: tokens per CPU second and per wall second, positions read per step
  (mean, peak) and held, the ratio to dense, and the cost model's predicted ratio for the same steps.
  Whole generations to 8k tokens at batch 16 are not what is timed: a dense one costs about two CPU hours on
  this machine, and the goal is about the speed at ~8k positions of context, which a window measures directly.
- **alpha**, per sparse arm: `--alpha-samples` generations of the short chat prompt below (not a calibration
  prompt) to `--alpha-length` new tokens (default: the whole context), temperature 1, EOS ignored, each with
  the arm's KV policy, and the exact alpha_t = sum_v min(p_sparse, p_dense) of every token against the dense
  model on the same prefix (`engine.acceptance.measure_acceptance`; an arm's samples are drawn in one call, since a
  batch-1 step costs about what a batch-2 step does, its weight reads, so their full distributions, 4 bytes x
  49,152 ids per token, 3.2 GB for 2 x 8140 tokens, are held at once), pooled per `--bin-width` bin of
  absolute position: P5, P1, mean, fraction below tau.

    python benchmarks/sparrow.py --resume --parts speed            # every arm at both contexts (~1 CPU hour)
    python benchmarks/sparrow.py --resume --parts alpha            # the sparse arms' alpha (~1 CPU hour)
    python benchmarks/sparrow.py --quick                           # a smoke run of a minute, temp file

Every process writes its cells into the same JSON under a lock (re-read, merged, replaced atomically);
`--resume` keeps the cells already there (same settings) and skips those done with the same KV policy.
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import json
import statistics
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
    runs_with_settings,
)
from sparrow_report import GOALS, goals_report, print_report, schedule_provenance, summarise
from sparse_rollout import PROMPT

from sparserl.cost import INTENSITY_PRESETS, resolve_intensity
from sparserl.cost.probe import time_decode_steps
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.acceptance import measure_acceptance
from sparserl.engine.schedule import parse_schedule
from sparserl.errors import UserError
from sparserl.eval.calibrate import DEFAULT_BIN_WIDTH, DEFAULT_TAU
from sparserl.models import encode_prompt, load_model
from sparserl.signals import stoppable

DEFAULT_SCHEDULE = RESULTS / "calibration" / "schedule.json"
# The fixed budget is 1024, twice the schedule's last budget (512, which holds from 768 positions on), so that
# the fixed arm is a second point on the speed/alpha curve rather than the schedule arm again.
FULL = {"batch": 16, "contexts": "4096,max", "window": 128, "alpha_length": "max", "budget": 1024,
        "bin_width": DEFAULT_BIN_WIDTH}  # fmt: skip
QUICK = {"batch": 2, "contexts": "96,160", "window": 16, "alpha_length": "96", "budget": 64, "bin_width": 32}
QUICK_OUT = Path(tempfile.gettempdir()) / "sparrow_quick.json"
PARTS = ("speed", "alpha")


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


def parse_choices(spec: str, choices, flag: str) -> list[str]:
    items = [x for x in spec.split(",") if x]
    unknown = [x for x in items if x not in choices]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"{flag}: {unknown or 'empty'}; choose from {', '.join(choices)}")
    return items


def parse_lengths(spec: str) -> list[str]:
    items = [x for x in spec.split(",") if x]
    if not items or any(x != "max" and not (x.isdigit() and int(x) > 0) for x in items):
        raise argparse.ArgumentTypeError(f"{spec!r}: comma-separated positive integers or 'max'")
    return items


def resolve_length(spec: str, limit: int, flag: str) -> int:
    """'max' is `limit`; a number must not exceed it."""
    length = limit if spec == "max" else int(spec)
    if length > limit:
        raise UserError(f"{flag} {length}: more than the {limit} the model's context allows")
    return length


def run_speed(bench: Bench, arms: dict[str, KVConfig | None], context: int) -> list[dict]:
    """Every arm's decode steps at contexts context - window + 2 ... context - 1, `--repeats` rounds with the
    arms alternating so that a drifting machine hits all alike."""
    args, times = bench.args, {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, kv in arms.items():
            kv = kv or KVConfig()
            got = time_decode_steps(
                bench.model, bench.tokenizer, [context - args.window], [kv], args.batch, args.window,
                args.threads, 1,
            )  # fmt: skip
            times[name].append(got[kv.method, context - args.window])
    runs = []
    for name, steps in times.items():
        cpu = statistics.median(t.cpu[0] for t in steps)
        wall = statistics.median(t.wall[0] for t in steps)
        runs.append({
            "part": "speed", "arm": name, "length": context, "kv": arms[name] and asdict(arms[name]),
            "cpu_step_s": [t.cpu[0] for t in steps], "wall_step_s": [t.wall[0] for t in steps],
            "tokens_per_cpu_s": args.batch / cpu, "tokens_per_s": args.batch / wall, **steps[-1].positions[0],
            "command": command_line(),
        })  # fmt: skip
        print(f"{name:>19} {context:>5}: {args.batch / cpu:.2f} tok/CPU-s, read "
              f"{runs[-1]['read_positions_mean']:.0f} / held {runs[-1]['held_positions_mean']:.0f}", flush=True)  # fmt: skip
    return runs


def run_alpha(model, tokenizer, name: str, kv: KVConfig, prompt: list[int], length: int, args) -> dict:
    """Exact alpha of `--alpha-samples` samples, drawn in one call (a decode step of a batch this small costs
    about its weight reads, whatever the batch), per position bin."""
    cpu0 = time.process_time()
    with measure() as m:
        alpha = measure_acceptance(
            model, tokenizer, [prompt], kv, args.alpha_samples, length, seed=args.seed, exact=True,
            samples_per_call=args.alpha_samples, ignore_eos=True,
        )  # fmt: skip
    bins = [b.to_dict() for b in alpha.binned(args.bin_width, args.tau)["exact"]]
    p5 = [b["p5"] for b in bins if b["p5"] is not None]
    print(f"{name:>19} {length:>5}: alpha P5 min {min(p5, default=None)} over {alpha.positions.numel()} tokens, "
          f"{time.process_time() - cpu0:.0f} CPU-s", flush=True)  # fmt: skip
    return {
        "part": "alpha", "arm": name, "length": length, "kv": asdict(kv), "samples": args.alpha_samples,
        "tokens": int(alpha.positions.numel()), "cpu_s": time.process_time() - cpu0, "wall_s": m["seconds"],
        "peak_rss_mib": mib(m["peak_rss_bytes"]), "min_p5": min(p5, default=None), "bins": bins,
        "command": command_line(),
    }  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; flags left out take the full run's defaults, or with --quick the smoke run's."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--parts", type=lambda s: parse_choices(s, PARTS, "--parts"), default=list(PARTS),
                    help="speed, alpha or both (default)")  # fmt: skip
    ap.add_argument("--batch", type=int, help="speed: samples decoding side by side (default 16)")
    ap.add_argument("--contexts", type=parse_lengths, help="speed: contexts at the end of the timed window, "
                    f"comma-separated; 'max' is the model's context (default {FULL['contexts']})")  # fmt: skip
    ap.add_argument("--window", type=int, help="speed: decode steps per timing (default 128)")
    ap.add_argument("--repeats", type=int, default=2, help="speed: timings per arm and context (median)")
    ap.add_argument("--alpha-length", help="alpha: new tokens per sample; 'max' fills the context")
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
    ap.add_argument("--budget", type=int, help="block_topk_fixed: positions read per step (default 1024)")
    ap.add_argument("--rkv-schedule", help="R-KV schedule file from `sparserl calibrate` (without it the "
                    "rkv_schedule arm is skipped)")  # fmt: skip
    ap.add_argument(
        "--alpha-samples", type=int, default=2, help="alpha: samples per sparse arm, one at a time"
    )
    ap.add_argument("--bin-width", type=int, help=f"alpha: positions per bin (default {FULL['bin_width']})")
    ap.add_argument("--tau", type=float, default=DEFAULT_TAU, help="alpha threshold of the tail goal")
    ap.add_argument("--intensity", type=resolve_intensity, default=INTENSITY_PRESETS["cpu-1t"],
                    help="the cost model's FLOPs per byte: a number or a preset (cpu-1t)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}, written to {QUICK_OUT}")
    ap.add_argument("--resume", action="store_true", help="keep the cells already in --out (same settings)")
    ap.add_argument("--redo", action="store_true", help="with --resume: measure the given cells again")
    ap.add_argument("--out", type=Path, help=f"JSON output (default {RESULTS / 'sparrow.json'})")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    args.grid = parse_lengths(defaults["contexts"])  # the contexts a complete file has
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, parse_lengths(value) if key == "contexts" else value)
    args.out = args.out or (QUICK_OUT if args.quick else RESULTS / "sparrow.json")
    if min(args.batch, args.threads, args.repeats, args.alpha_samples) < 1 or args.window < 3:
        ap.error("--batch, --threads, --repeats and --alpha-samples must be >= 1, --window >= 3")
    return args


def fresh(on_disk: dict, key: tuple, kv: KVConfig | None, redo: bool) -> bool:
    """A cell to measure: none on disk with the same KV policy, or --redo."""
    old = on_disk.get(key)
    return redo or old is None or old["kv"] != (kv and asdict(kv))


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
        summary = summarise(runs, self.model, args)
        done = {(r["part"], r["arm"]) if r["part"] == "alpha" else (r["arm"], r["length"]) for r in runs}
        missing = [[a, n] for n in self.grid for a in ARMS if (a, n) not in done]
        missing += [["alpha", a] for a in ARMS if a != "dense" and ("alpha", a) not in done]
        return {
            "benchmark": "Sparrow rollouts: dense vs block_topk (calibrated schedule, fixed budget) vs R-KV "
            "(calibrated schedule), sparserl RolloutEngine",
            "command": command_line(),
            "commands": [*dict.fromkeys(r["command"] for r in runs)],
            "missing": missing,
            "settings": self.settings,
            "dtype": "float32",
            "speed_method": f"per arm and context C: {args.batch} samples decode {args.window} steps after a "
            f"shared prefill of C - {args.window} random token ids; CPU and wall seconds per step clocked "
            "between the engine's step callbacks (prefill excluded), median of the repeats, arms alternating",
            "positions_note": "read_positions_mean/peak: positions one sparse layer's KV head attends to per "
            "decode step (block_topk's dense layers read all); held_positions_mean: positions a sequence "
            "holds",
            "alpha_method": f"exact alpha of {args.alpha_samples} samples per sparse arm of the short prompt, "
            "drawn in one call, temperature 1, EOS ignored, with the arm's KV policy, "
            f"scored by the dense model on the same prefixes; P5 per {args.bin_width}-position bin "
            "(engine.acceptance.measure_acceptance)",
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
            self.args.out, self.settings, mine, ("part", "arm", "length"), self.args.resume, self.build
        )


def load(args: argparse.Namespace) -> Bench:
    """Load the model and encode the prompt; the settings every merged run must share."""
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": PROMPT}])
    context = RolloutEngine(model, tokenizer).decoder.max_positions
    args.contexts = [resolve_length(c, context, "--contexts") for c in args.contexts]
    if min(args.contexts) <= args.window:
        raise UserError(f"--contexts {min(args.contexts)}: not above --window {args.window}")
    args.alpha_length = resolve_length(args.alpha_length, context - len(prompt), "--alpha-length")
    settings = {"model": args.model, "batch": args.batch, "window": args.window, "prompt": PROMPT,
                "prompt_tokens": len(prompt), "context": context, "threads": args.threads, "seed": args.seed,
                "alpha_samples": args.alpha_samples, "alpha_length": args.alpha_length,
                "bin_width": args.bin_width, "tau": args.tau, "intensity": args.intensity}  # fmt: skip
    grid = [resolve_length(c, context, "--contexts") for c in args.grid]
    return Bench(args, model, tokenizer, prompt, settings, grid, load_s)


def measure_cells(bench: Bench, arms: dict[str, KVConfig | None], on_disk: dict) -> list[dict]:
    """The speed cells per context (every arm again when one is due, so that the ratio is taken on one
    machine state), then each sparse arm's alpha; the report is written after each."""
    args, mine = bench.args, []
    if "speed" in args.parts:
        for context in args.contexts:
            if any(fresh(on_disk, ("speed", name, context), kv, args.redo) for name, kv in arms.items()):
                mine += run_speed(bench, arms, context)
                bench.write(mine)
    if "alpha" in args.parts:
        for name, kv in arms.items():
            if kv is not None and fresh(on_disk, ("alpha", name, args.alpha_length), kv, args.redo):
                mine.append(
                    run_alpha(bench.model, bench.tokenizer, name, kv, bench.prompt, args.alpha_length, args)
                )
                bench.write(mine)
    return mine


@stoppable("benchmarks/sparrow.py", "cells not yet written are lost; run it again with --resume", exits=True)
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
    on_disk = {(r["part"], r["arm"], r["length"]): r for r in kept}
    if args.resume:
        print(f"resuming: {len(on_disk)} cells kept from {args.out}", flush=True)
    mine = measure_cells(bench, arms, on_disk)
    final = bench.write(mine) if mine or not args.out.is_file() else json.loads(args.out.read_text())
    print_report(final["summary"], list(ARMS))
    for name, entry in final["goals"].items():
        print(f"{'MET' if entry['met'] else 'not met'}: {name}: {entry['value']}")
    print(f"{'wrote' if mine else 'nothing to measure; read'} {args.out}")
    return final


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        sys.exit(f"error: {err}")
