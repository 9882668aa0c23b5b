"""The Sparrow frontier table: per block_topk budget x length bin up to 8k positions, alpha's P5
with its 90% interval and the decode speed against dense at that length, so that whether speed and tail can both
hold at a length is read off one table.

- **Tail**, per (budget, bin): `sparserl calibrate`'s measurement (eval/calibrate.py) on long_arithmetic prompts
  of graded length (`--lengths`, each prompt ending `--new-tokens` before its target, `--prompts` problems per
  length, `--n` samples each, temperature 1, EOS ignored), the exact alpha of every generated token, P5 and its
  sequence-level bootstrap 90% interval per bin of `--bin-width` positions.
- **Speed**, per (regime, arm, length): `--batch` samples decoding `--window` steps at contexts ending at the
  length (`sparserl.cost.probe.time_decode_steps`: one prefill of random ids, the steps clocked between step
  hooks), dense and every budget alternating, `--repeats` times, median CPU seconds per step, in two regimes:
  `own_context`, every row holding its own copy of the context (what the RL case costs, where the long context
  is each sample's own generation: the table's `speedup_vs_dense`), and `shared_prompt`, the rows reading one
  prompt held once (the engine's default for a group sharing a long prompt: `speedup_shared_prompt`).
- **The best schedule**: per bin the smallest budget whose P5 lower bound is >= `--tau` (calibrate's rule), and
  its speed-up over dense at each length (dense CPU s per step / the chosen budget's).

    python benchmarks/frontier.py --resume   # all 240 units kept: the speed table alone, ~40 CPU-min
    python benchmarks/frontier.py --quick           # tiny model, short lengths: a smoke run, a temp file
    python benchmarks/frontier.py --resume --parts tail --device cuda   # the units on a GPU (fp32, no TF32)

Each unit records the device it ran on (its metadata); the speed table is always this machine's CPU seconds.

Writes docs/results/sparrow_frontier.json and adds its goals to docs/results/sparrow.json's `goals`.
`--resume` keeps the finished calibration units (docs/results/sparrow_frontier_units/).
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info

from sparserl.cost.probe import time_decode_steps
from sparserl.engine import KVConfig
from sparserl.engine.prefill_reuse import reusing_prefills
from sparserl.eval.calibrate import CalibrationSettings, budget_grid, calibrate
from sparserl.eval.calibrate_prompts import graded_length_prompts

OUT = RESULTS / "sparrow_frontier.json"
GOAL_TABLE = "Frontier: the table covers budgets x length bins up to 8192 positions"
GOAL_BEST = (
    "Frontier: a calibrated schedule keeps tau at every bin (its speed-up at the longest length reported)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--budgets", default="256:2048:1.5", help="LOW:HIGH:RATIO budget grid (page multiples)")
    ap.add_argument("--lengths", default="1024,2048,4096,6144,8192", help="target lengths (positions)")
    ap.add_argument("--prompts", type=int, default=8, help="problems per length (default 8)")
    ap.add_argument("--n", type=int, default=4, help="samples per problem (default 4: 32 sequences a cell)")
    ap.add_argument("--new-tokens", type=int, default=128, help="sampled tokens after each prompt")
    ap.add_argument("--bin-width", type=int, default=1024, help="positions per bin (default 1024)")
    ap.add_argument(
        "--batch", type=int, default=16, help="speed: samples decoding side by side (the RL batch)"
    )
    ap.add_argument("--window", type=int, default=32, help="speed: decode steps timed per length")
    ap.add_argument("--repeats", type=int, default=2, help="speed: timings per arm and length (median)")
    ap.add_argument(
        "--tau", type=float, default=0.86, help="the tail threshold (lower bound of P5's interval)"
    )
    ap.add_argument("--page-size", type=int, default=16, help="block_topk page size")
    ap.add_argument("--dense-layers", default="0,1", help="block_topk: layers that stay dense")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--resume", action="store_true", help="keep the finished calibration units")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the tail's calibration units run (cpu, cuda); speed is CPU seconds",
    )
    ap.add_argument(
        "--parts", choices=["all", "tail"], default="all",
        help="tail: measure the calibration units only (e.g. on a GPU), keep them (resuming), write no table",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="tiny model, lengths 400,700, a temp file")
    ap.add_argument("--out", type=Path, default=OUT, help=f"JSON output (default {OUT})")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.budgets, args.lengths, args.bin_width = "tiny-llama", "24:48:1.5", "400,700", 200
        args.prompts, args.n, args.new_tokens, args.window, args.repeats, args.page_size = 2, 2, 16, 4, 1, 8
        args.dense_layers = "0"
        if args.out == OUT:
            args.out = Path(tempfile.gettempdir()) / "sparrow_frontier_quick.json"
    return args


def units_dir(args: argparse.Namespace) -> Path:
    """Where the calibration units are kept: beside the JSON output (<stem>_units/)."""
    return args.out.with_name(args.out.stem + "_units")


def dense_layers(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.dense_layers.split(",") if x.strip()]


def tail_table(model, tok, args: argparse.Namespace, budgets: list[int]) -> tuple[dict, list[dict]]:
    """The calibration report over the graded-length prompts, and what each prompt is."""
    from sparserl.tasks import TaskConfig, make_task

    task = make_task(TaskConfig(name="long_arithmetic"), "test")
    targets = [int(x) - args.new_tokens for x in args.lengths.split(",")]
    context = getattr(model.config, "max_position_embeddings", None)  # each prompt + its tokens must fit
    room = context - args.new_tokens if context else None
    prompts, described = graded_length_prompts(task, tok, targets, args.prompts, max_tokens=room)
    kv_options = {"page_size": args.page_size, "dense_layers": dense_layers(args)}
    s = CalibrationSettings("block_topk", kv_options, n=args.n, max_new_tokens=args.new_tokens,
                            bin_width=args.bin_width, tau=args.tau, ignore_eos=True)  # fmt: skip
    report = calibrate(model, tok, prompts, budgets, s, store_dir=units_dir(args), resume=args.resume)
    return report, described


REGIMES = {"own_context": False, "shared_prompt": True}  # regime -> time_decode_steps' share_prompts


def speed_table(model, tok, args: argparse.Namespace, budgets: list[int]) -> dict[str, dict[int, dict]]:
    """Median CPU seconds per decode step per regime, length and arm ('dense' and each budget), alternating."""
    lengths = [int(x) for x in args.lengths.split(",")]
    arms = {"dense": KVConfig()} | {
        str(b): KVConfig(
            method="block_topk", budget=b, page_size=args.page_size, dense_layers=dense_layers(args)
        )
        for b in budgets
    }
    cpu = {r: {n: {a: [] for a in arms} for n in lengths} for r in REGIMES}
    for repeat in range(args.repeats):
        for length in lengths:
            # every arm and regime shares one prefill of the prompt (it is not clocked)
            with reusing_prefills():
                for (regime, share), (name, kv) in itertools.product(REGIMES.items(), arms.items()):
                    got = time_decode_steps(model, tok, [length - args.window], [kv], args.batch, args.window,
                                            args.threads, 1, share_prompts=share)  # fmt: skip
                    cpu[regime][length][name].append(got[kv.method, length - args.window].cpu[0])
                    step_ms = cpu[regime][length][name][-1] * 1e3
                    print(
                        f"repeat {repeat} length {length} {regime} {name}: {step_ms:.0f} ms/step", flush=True
                    )
    return {
        r: {n: {a: statistics.median(v) for a, v in per.items()} for n, per in t.items()}
        for r, t in cpu.items()
    }


def frontier(report: dict, speed: dict[str, dict[int, dict]], args: argparse.Namespace) -> dict:
    """The table (per budget: per bin P5, its interval and the speed-ups at the bin's length, rows holding their
    own contexts and reading a shared prompt) and the best schedule with its speed-ups per length."""
    own, shared = speed["own_context"], speed["shared_prompt"]
    lengths = sorted(own)

    def speedups(n: int | None, arm: str) -> dict[str, float | None]:
        if n is None:
            return {"speedup_vs_dense": None, "speedup_shared_prompt": None}
        return {"speedup_vs_dense": own[n]["dense"] / own[n][arm],
                "speedup_shared_prompt": shared[n]["dense"] / shared[n][arm]}  # fmt: skip

    def length_of(b: dict) -> int | None:  # the target length whose generated tokens fall in this bin
        return next((n for n in lengths if b["start"] < n <= b["end"]), None)

    rows = []
    for row in report["table"]:
        cells = []
        for b in row["bins"]:
            n = length_of(b)
            cells.append({k: b[k] for k in ("start", "end", "sequences", "p5", "p5_low", "p5_high")} |
                         {"length": n} | speedups(n, row["label"]))  # fmt: skip
        rows.append({"budget": row["budget"], "cells": cells})
    chosen = {r["index"]: r for r in report["schedule_bins"]}
    best = []
    for b in report["table"][0]["bins"]:
        n, record = length_of(b), chosen[b["index"]]
        if n is not None:
            best.append({"length": n, "budget": record["budget"], "reason": record["reason"]} |
                        speedups(n, str(record["budget"])))  # fmt: skip
    return {"rows": rows, "best_schedule": best, "schedule": report["schedule"]}


def units_by_device(units: Path) -> dict[str, int]:
    """How many unit files the store holds per device that measured them (their metadata; units from before
    it was recorded count as cpu)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for path in sorted(units.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            device = (f.metadata() or {}).get("device", "cpu")
        counts[device] = counts.get(device, 0) + 1
    return counts


def table_lines(table: dict) -> list[str]:
    """Per budget, each measured bin's P5 and, where a target length ends in the bin, its speed-up."""
    lines = []
    for row in table["rows"]:
        cells = [f"{c['p5']:.2f}" + (f"/{c['speedup_vs_dense']:.2f}x" if c["length"] else "")
                 for c in row["cells"] if c["p5"] is not None]  # fmt: skip
        lines.append(f"{row['budget']:>6}  " + "  ".join(cells))
    return lines


def goals(table: dict) -> dict:
    command = "python benchmarks/frontier.py --resume"
    best = table["best_schedule"]
    measured = [c["length"] for r in table["rows"] for c in r["cells"] if c["p5"] is not None and c["length"]]
    longest = max(measured, default=0)
    passes = bool(best) and all(not b["reason"].startswith("no budget passes") for b in best)
    return {
        GOAL_TABLE: {"value": longest, "target": 8192, "met": longest >= 8192, "command": command},
        GOAL_BEST: {
            "value": best[-1]["speedup_vs_dense"] if best else None, "target": 1.0, "met": passes,
            "command": command, "per_length": best,
            "reason": "met means a schedule keeps P5's lower bound >= tau at every bin; its speed-up (value: rows "
            "holding their own contexts, as in RL where the long context is each sample's generation; "
            "per_length also gives it with a shared prompt) is reported, not judged",
        },
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    from sparserl.models import load_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on a GPU too: the units compare with CPU ones
    if args.parts == "tail":
        args.resume = True  # a tail-only run adds units, never clears those measured elsewhere
    model, tok = load_model(args.model)
    low, high, ratio = args.budgets.split(":")
    budgets = budget_grid(int(low), int(high), float(ratio), args.page_size)
    report, described = tail_table(model.to(args.device), tok, args, budgets)
    if args.parts == "tail":
        print(f"calibration units kept in {units_dir(args)}")
        return report
    speed = speed_table(model.to("cpu"), tok, args, budgets)
    table = frontier(report, speed, args)
    judged = goals(table)
    out = {"benchmark": "Sparrow frontier: P5 (90% interval) and decode speed-up per block_topk budget x length",
           "command": command_line(), "settings": vars(args) | {"out": str(args.out)}, "budgets": budgets,
           "prompts": described, "cpu_step_s": speed, "frontier": table, "machine": machine_info(),
           "units_by_device": units_by_device(units_dir(args)),
           "goals": judged}  # fmt: skip
    args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    if not args.quick:
        sparrow = json.loads((RESULTS / "sparrow.json").read_text())
        sparrow["goals"] |= judged
        (RESULTS / "sparrow.json").write_text(json.dumps(sparrow, indent=1) + "\n")
    print("\n".join(table_lines(table)))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
