"""`sparserl plot`, `sparserl cost` and `sparserl calibrate`: flags; the work is in their own modules."""

from __future__ import annotations

import argparse

from sparserl.cli.common import MODEL_LOAD_ARGS, ROW_FIELD_ARGS, arg, command

# ---------------------------------------------------------------------------------------------- plot


@command(
    "plot",
    "Draw a run's curves (reward, length, mismatch, rejection, KV, optimizer) to PNG; several runs overlay.",
    arg("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files) to draw"),
    arg(
        "--out",
        "-o",
        default=None,
        help="output directory (default: RUN_DIR/plots; ./plots for several runs)",
    ),
    arg("--smooth", type=int, default=0, help="moving-average window drawn over the raw curves (0: off)"),
)
def plot(args: argparse.Namespace) -> int:
    """`sparserl plot`: see sparserl/plot.py."""
    from sparserl.plot import main as plot_main

    return plot_main(args.runs, args.out, args.smooth)


# ---------------------------------------------------------------------------------------------- cost


def _cost_epilog() -> str:
    from sparserl.cost.probe import INTENSITY_PRESETS

    presets = ", ".join(f"{name} = {value:.3g}" for name, value in INTENSITY_PRESETS.items())
    return (
        f"--intensity presets (FLOPs per byte): {presets}\n\n"
        "examples:\n"
        "  sparserl cost --prompt-len 64 --output-len 8000 --n 16 --budget 1024\n"
        "  sparserl cost --schedule calibrated.json --methods dense,block_topk --mem-cap 4GiB --json\n"
        "  sparserl cost --model path/to/Qwen3-1.7B --dtype bfloat16 --intensity h200 --n 8 --output-len 16000\n"
        "  sparserl cost --probe --threads 1                     # measure I on this CPU\n"
        "  sparserl cost --probe-decode 64,2048 --methods dense,h2o   # check the model against the engine\n"
        "See docs/cost_model.md."
    )


@command(
    "cost",
    "Predict the rollout speed-up and memory of dense, eviction and block-sparse KV from a cost model.",
    arg("--model", "-m", default="smollm2-135m", help="model folder, .gguf or smollm2-135m (config only)"),
    arg("--dtype", default="float32", help="float32, bfloat16 or float16: bytes per weight and KV element"),
    arg("--prompt-len", type=int, default=64, help="prompt tokens (default 64)"),
    arg("--output-len", type=int, default=4096, help="new tokens per sample, EOS ignored (default 4096)"),
    arg("--n", type=int, default=16, help="samples of the prompt decoded together (default 16)"),
    arg("--methods", default="dense,rkv,block_topk", help="kv.method names, comma-separated (dense always)"),
    arg("--budget", type=int, default=512, help="KV budget of the sparse methods (default 512)"),
    arg("--schedule", help="replaces --budget: [[from_length, budget], ...] or a JSON/YAML file"),
    arg("--interval", type=int, default=128, help="eviction: decode steps between cuts (default 128)"),
    arg("--page-size", type=int, default=16, help="block_topk: tokens per page (default 16)"),
    arg("--dense-layers", default="0,1", help="block_topk: layers that stay dense (default 0,1)"),
    arg(
        "--kv-quant",
        default="none",
        help="kv.quant of every listed method (none, int8 or fp8; default none): their KV counted in quantized "
        "bytes, a quantized dense row added; the dense baseline stays full precision",
    ),
    arg("--intensity", default="cpu-1t", help="FLOPs per byte: a number or a preset (default cpu-1t)"),
    arg("--mem-cap", default="4GiB", help="KV memory for the 'seqs at cap' column (default 4GiB)"),
    arg("--json", action="store_true", help="print the report as JSON"),
    arg("--probe", action="store_true", help="instead, measure this machine's FLOPs per byte (--threads)"),
    arg("--probe-decode", metavar="LENGTHS", help="instead, time the engine's steps at these prompt lengths"),
    arg("--decode-steps", type=int, default=17, help="--probe-decode: new tokens per timing (default 17)"),
    arg("--repeats", type=int, default=3, help="--probe-decode: timings per cell, interleaved (default 3)"),
    arg("--threads", type=int, default=1, help="--probe, --probe-decode: torch threads (default 1)"),
    epilog=_cost_epilog,
)
def cost(args: argparse.Namespace) -> int:
    """`sparserl cost`: see sparserl/cost/report.py."""
    from sparserl.cost.report import cost_command

    return cost_command(args)


# ---------------------------------------------------------------------------------------------- calibrate


def _calibrate_epilog() -> str:
    return (
        "Per candidate budget and length bin, the P5 of the acceptance rate alpha (sparse sampler vs dense\n"
        "policy, per token) over --prompts x --n samples, with its 90% interval (a bootstrap over sequences);\n"
        "the schedule takes per bin the smallest budget whose lower bound is >= --tau, made non-decreasing.\n"
        "Use >= 32 sequences per cell (e.g. --prompts 16 --n 4): fewer are flagged. A stopped calibration\n"
        "goes on with --resume (finished units are kept under OUT/units).\n"
        "--out gets calibration.json (the table, settings, command), calibration.png (the heatmap) and\n"
        "schedule.json (use it as kv.schedule=OUT/schedule.json). With\n"
        "--schedule instead of --budgets: check that schedule on other prompts (--offset), writing check.json\n"
        "and check.png.\n\n"
        "examples:\n"
        "  sparserl calibrate --data long_arithmetic --method block_topk --budgets 64:512:1.33 --prompts 16 --n 4 \\\n"
        "      --max-new-tokens 1024 --ignore-eos --threads 1 --out calibration/\n"
        "  sparserl calibrate --data long_arithmetic --method block_topk --schedule calibration/schedule.json \\\n"
        "      --offset 100 --n 4 --max-new-tokens 1024 --ignore-eos --out calibration/check/\n"
        "  sparserl calibrate --model runs/<run> --method rkv --budgets 128,256,512 --window 8 --interval 128\n"
        "See docs/calibration.md."
    )


@command(
    "calibrate",
    "Calibrate a KV budget schedule by the tail (P5) of the sparse-vs-dense acceptance rate per length bin.",
    arg("--model", "-m", default="smollm2-135m", help="run directory, HF id/folder, .gguf or smollm2-135m"),
    arg("--data", "-d", default=None, help="prompts: a data file, gsm8k, an eval set or a built-in task"),
    *ROW_FIELD_ARGS,
    arg("--prompts", type=int, default=4, help="calibration prompts (default 4)"),
    arg("--offset", type=int, default=0, help="index of the first prompt; held-out checks use others"),
    arg(
        "--method",
        default="block_topk",
        help="a kv.method other than dense (`sparserl train --help` lists them; default block_topk)",
    ),
    arg(
        "--budgets",
        default=None,
        help="candidate budgets: comma-separated (64,128,256) or a grid "
        "LOW:HIGH:RATIO (64:1024:1.33, multiples of the page size, or of 16)",
    ),
    arg("--schedule", default=None, help="instead of --budgets: check this schedule (file or table)"),
    arg("--n", type=int, default=8, help="samples per prompt (default 8)"),
    arg("--max-new-tokens", type=int, default=1024, help="completion length cap (default 1024)"),
    arg("--bin-width", type=int, default=512, help="tokens of absolute position per bin (default 512)"),
    arg("--tau", type=float, default=0.86, help="P5 threshold of alpha, in (0, 1] (default 0.86)"),
    arg("--estimate", default="exact", help="alpha estimate: exact (default) or topk (Sparrow's bound)"),
    arg("--top-logprobs", type=int, default=20, help="k of the top-k estimate (default 20)"),
    arg("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0, as RL)"),
    arg("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)"),
    arg("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default)"),
    arg("--seed", type=int, default=0, help="sampling seed, the same for every budget"),
    arg("--ignore-eos", action="store_true", help="sample every completion to --max-new-tokens"),
    arg("--samples-per-call", type=int, default=0, help="samples generated at a time; 0: all n"),
    arg(
        "--resamples",
        type=int,
        default=1000,
        help="sequence-level bootstrap draws of each P5's 90%% interval; "
        "the schedule takes the smallest budget whose lower bound >= tau (0: no interval, judged by P5)",
    ),
    arg(
        "--lengths",
        default=None,
        help="long_arithmetic: prompts of graded length, comma-separated targets in tokens (e.g. "
        "1024,2048,4096,6144,8192), --prompts of each, each followed by --max-new-tokens",
    ),
    arg(
        "--resume", action="store_true", help="go on from the units a stopped calibration into --out finished"
    ),
    arg("--page-size", type=int, default=16, help="block_topk: tokens per page (default 16)"),
    arg("--dense-layers", default="0,1", help="block_topk: layers that stay dense (default 0,1)"),
    arg("--window", type=int, default=None, help="eviction: always-kept recent positions"),
    arg("--interval", type=int, default=None, help="eviction: decode steps between cuts"),
    arg("--out", "-o", default="calibration", help="output directory (default ./calibration)"),
    *MODEL_LOAD_ARGS,
    arg("--quiet", "-q", action="store_true", help="no progress on stderr"),
    epilog=_calibrate_epilog,
)
def calibrate(args: argparse.Namespace) -> int:
    """`sparserl calibrate`: see sparserl/eval/calibrate_command.py."""
    from sparserl.eval.calibrate_command import calibrate_command

    return calibrate_command(args)
