"""What reusing a prompt's prefills across budgets saves a long-prompt calibration (engine/prefill_reuse.py).

One graded-length long_arithmetic prompt (the frontier's, `--length` positions with its sampled tokens), its
units under each `--budgets` block_topk budget (n samples x new tokens, exact alpha: calibrate's measure_unit),
measured two ways, alternating, `--repeats` times: `alone` (each unit on its own, as before the reuse) and
`shared` (the prompt's units in one `reusing_prefills()` scope, as `sparserl calibrate` now runs them). Records
the process CPU seconds of each arm (median) and whether the shared units equal the alone ones bit for bit.

    python benchmarks/prefill_reuse.py      # SmolLM2-135M, 4096 positions, budgets 256,576,1296: ~15 CPU-min
    python benchmarks/prefill_reuse.py --quick   # tiny model, short prompt, a temp file

Writes docs/results/prefill_reuse.json.
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info, write_json

from sparserl.engine.prefill_reuse import reusing_prefills
from sparserl.eval.calibrate import CalibrationSettings, measure_unit
from sparserl.eval.calibrate_prompts import graded_length_prompts

OUT = RESULTS / "prefill_reuse.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--length", type=int, default=4096, help="prompt + sampled tokens (positions)")
    ap.add_argument("--budgets", default="256,576,1296", help="block_topk budgets (page multiples)")
    ap.add_argument("--n", type=int, default=4, help="samples per unit")
    ap.add_argument("--new-tokens", type=int, default=128, help="sampled tokens after the prompt")
    ap.add_argument("--repeats", type=int, default=2, help="timings per arm (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--quick", action="store_true", help="tiny model, a short prompt, a temp file")
    ap.add_argument("--out", type=Path, default=OUT, help=f"JSON output (default {OUT})")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.length, args.budgets = "tiny-llama", 400, "24,48"
        args.n, args.new_tokens, args.repeats = 2, 16, 1
        if args.out == OUT:
            args.out = Path(tempfile.gettempdir()) / "prefill_reuse_quick.json"
    return args


def measure(model, tok, prompt, settings, budgets, shared: bool) -> tuple[list, float]:
    """Every budget's unit of `prompt`, with or without reuse, and the process CPU seconds they took."""
    t0 = time.process_time()
    with reusing_prefills() if shared else nullcontext():
        units = [measure_unit(model, tok, prompt, settings.kv(budget=b), settings) for b in budgets]
    return units, time.process_time() - t0


def identical(a: list, b: list) -> bool:
    fields = ("positions", "topk", "exact", "sequences")
    return all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a, b, strict=True) for f in fields)


def main(argv: list[str] | None = None) -> dict:
    from sparserl.models import load_model
    from sparserl.tasks import TaskConfig, make_task

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    task = make_task(TaskConfig(name="long_arithmetic"), "test")
    (prompt,), described = graded_length_prompts(task, tok, [args.length - args.new_tokens], 1)
    page = 8 if args.quick else 16
    dense = [0] if args.quick else [0, 1]
    settings = CalibrationSettings("block_topk", {"page_size": page, "dense_layers": dense}, n=args.n,
                                   max_new_tokens=args.new_tokens, ignore_eos=True)  # fmt: skip
    budgets = [int(b) for b in args.budgets.split(",")]
    cpu: dict[str, list[float]] = {"alone": [], "shared": []}
    same = True
    for repeat in range(args.repeats):
        order = ("alone", "shared") if repeat % 2 == 0 else ("shared", "alone")
        got = {}
        for arm in order:
            got[arm], seconds = measure(model, tok, prompt, settings, budgets, arm == "shared")
            cpu[arm].append(seconds)
            print(f"repeat {repeat} {arm}: {seconds:.1f} CPU-s", flush=True)
        same = same and identical(got["alone"], got["shared"])
    medians = {arm: statistics.median(v) for arm, v in cpu.items()}
    out = {
        "benchmark": "a prompt's calibration units under several budgets: each alone vs sharing its prefills",
        "command": command_line(), "settings": vars(args) | {"out": str(args.out)}, "prompt": described,
        "cpu_s": cpu, "median_cpu_s": medians, "alone_over_shared": medians["alone"] / medians["shared"],
        "units_identical": same, "machine": machine_info(),
        "goals": {},  # no issue sets a target: the saving is reported
    }  # fmt: skip
    write_json(args.out, out)
    print(f"alone {medians['alone']:.1f} / shared {medians['shared']:.1f} CPU-s = "
          f"{out['alone_over_shared']:.2f}x, identical: {same}; wrote {args.out}")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
