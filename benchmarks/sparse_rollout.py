"""Sparse rollouts: dense KV cache vs each eviction method (R-KV, SnapKV, H2O, StreamingLLM, random), same model.

One short chat prompt, `--batch` samples of it (n = batch, as a GRPO group), temperature 1, EOS ignored
(`engine.eos_ids = set()`) so that every sample reaches the generation length. Per method and length it reports
the engine's own statistics (tokens/s over prefill + decode, decode and compression seconds, peak KV positions and
bytes, retained fraction, compression events) and the process memory (RSS high-water mark during the call, and
its growth over the RSS before the call). Model load and a short warm-up are excluded.

The largest batch under a KV memory cap (`--kv-cap-gib`) is computed, not measured: the engine allocates
`positions x bytes_per_position` per sequence, with positions = prompt + length for dense and
min(budget + interval - 1, prompt + length) for an eviction method; the measured `peak_kv_bytes` of every run is
checked against that rule.

    python benchmarks/sparse_rollout.py                      # batch 16, budget 512, 1k/2k/4k, all methods: hours
    python benchmarks/sparse_rollout.py --lengths 4096 --methods dense,rkv
    python benchmarks/sparse_rollout.py --quick              # a smoke run of a few minutes, prints only

Each finished run is written to the JSON at once (`"complete": false` until the end); `--resume` skips the
(method, length) pairs already in it when the settings match, so an interrupted run can be continued.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    RESULTS,
    command_line,
    machine_info,
    mib,
    peak_is_resettable,
    print_table,
    timed_rollout,
    write_json,
)

from sparserl.engine import EVICTION_METHODS, KVConfig  # noqa: E402

BENCH_METHODS = ("dense", *EVICTION_METHODS)  # block-sparse attention has its own benchmark (sparrow.py)
from sparserl.models import encode_prompt, load_model  # noqa: E402
from sparserl.signals import stoppable  # noqa: E402

PROMPT = "Write a very long story about a lighthouse keeper who counts ships. Go on for as long as you can."
DEFAULT_LENGTHS = [1024, 2048, 4096]
GOALS = {"kv_reduction_min": 0.85, "speedup_min": 3.0, "compress_share_max": 0.10}


def parse_list(kind, spec: str) -> list:
    try:
        items = [kind(x) for x in spec.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected a comma-separated list") from None
    if not items:
        raise argparse.ArgumentTypeError("empty list")
    return items


def methods_arg(spec: str) -> list[str]:
    methods = parse_list(str, spec)
    unknown = [m for m in methods if m not in BENCH_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"--methods: unknown {unknown}; choose from {', '.join(BENCH_METHODS)}"
        )
    return methods


def run_one(
    model, tokenizer, kv: KVConfig | None, prompt: list[int], batch: int, length: int, seed: int
) -> dict:
    """One `generate` call of `batch` samples of `length` tokens; the engine's stats plus process memory."""
    out, timing = timed_rollout(model, tokenizer, kv, prompt, batch, length, seed)
    st = out.stats
    return {
        "wall_s": timing["wall_s"],
        "tokens_per_s": st["tokens_per_s"],
        "prefill_s": st["prefill_s"],
        "decode_s": st["decode_s"],
        "compress_s": st["compress_s"],
        "compress_share": st["compress_s"] / st["decode_s"] if st["decode_s"] else 0.0,
        "decode_step_s": st["decode_s"] / max(length - 1, 1),
        "peak_kv_positions": st["peak_kv_positions"],
        "peak_kv_bytes": st["peak_kv_bytes"],
        "kv_bytes_per_position": st["kv_bytes_per_position"],
        "retained_fraction": st["retained_fraction"],
        "compression_events": st["compression_events"],
        **{k: v for k, v in timing.items() if k != "wall_s"},
    }


def held_positions(method: str, args, prompt_len: int, length: int) -> int:
    """Positions the engine allocates per sequence (the cache capacity)."""
    if method == "dense":
        return prompt_len + length
    return min(args.budget + args.interval - 1, prompt_len + length)


def settings_of(args, prompt_len: int) -> dict:
    return {
        "model": args.model,
        "batch": args.batch,
        "prompt_tokens": prompt_len,
        "budget": args.budget,
        "interval": args.interval,
        "window": args.window,
        "granularity": args.granularity,
        "threads": torch.get_num_threads(),
        "seed": args.seed,
    }


def summarise(runs: list[dict], args) -> list[dict]:
    """Per run: ratios against the dense run of the same length, the computed batch under the KV cap, goals."""
    cap = args.kv_cap_gib * 2**30
    dense = {r["length"]: r for r in runs if r["method"] == "dense"}
    rows = []
    for r in runs:
        per_seq = r["positions_per_sequence"] * r["kv_bytes_per_position"]
        row = dict(r, max_batch_at_cap=int(cap // per_seq))
        d = dense.get(r["length"])
        if d is not None and r["method"] != "dense":
            row["speedup_vs_dense"] = r["tokens_per_s"] / d["tokens_per_s"]
            if r.get("cpu_s") and d.get("cpu_s"):
                row["cpu_speedup_vs_dense"] = r["tokens_per_cpu_s"] / d["tokens_per_cpu_s"]
            row["kv_reduction_vs_dense"] = 1 - r["peak_kv_bytes"] / d["peak_kv_bytes"]
            row["rss_growth_ratio_vs_dense"] = (
                r["peak_growth_mib"] / d["peak_growth_mib"] if d["peak_growth_mib"] else None
            )
            row["max_batch_ratio_vs_dense"] = row["max_batch_at_cap"] / max(
                int(cap // (d["positions_per_sequence"] * d["kv_bytes_per_position"])), 1
            )
            row["goals"] = {
                "kv_reduction": row["kv_reduction_vs_dense"] >= GOALS["kv_reduction_min"],
                # CPU-second throughput when both arms have it: one thread each, so on an idle machine it equals
                # wall-clock throughput, and on a shared one it is not skewed by what else ran at the time
                "speedup": row.get("cpu_speedup_vs_dense", row["speedup_vs_dense"]) >= GOALS["speedup_min"],
                "compress_share": r["compress_share"] < GOALS["compress_share_max"],
            }
        rows.append(row)
    return rows


def goals_report(summary: list[dict]) -> dict:
    """The top-level goals at the longest length measured (4k by default): value, target, met, command. KV and
    compression goals take the worst eviction method, the speed goal the best (per CPU second when measured)."""
    longest = max((r["length"] for r in summary if "goals" in r), default=None)
    rows = [r for r in summary if r["length"] == longest and "goals" in r]
    if not rows:
        return {}
    command = "python benchmarks/sparse_rollout.py"
    speed = {r["method"]: r.get("cpu_speedup_vs_dense", r["speedup_vs_dense"]) for r in rows}
    kv = min(r["kv_reduction_vs_dense"] for r in rows)
    share = max(r["compress_share"] for r in rows)
    return {
        f"KV >= 85% below dense at {longest} new tokens": {
            "value": kv, "target": GOALS["kv_reduction_min"], "met": kv >= GOALS["kv_reduction_min"],
            "command": command,
        },
        f"tokens per CPU second >= 3x dense at {longest} new tokens (best method)": {
            "value": max(speed.values()), "target": GOALS["speedup_min"],
            "met": max(speed.values()) >= GOALS["speedup_min"], "per_method": speed, "command": command,
        },
        "compression < 10% of decode time (dearest method)": {
            "value": share, "target": GOALS["compress_share_max"], "met": share < GOALS["compress_share_max"],
            "command": command,
        },
    }  # fmt: skip


def print_report(rows: list[dict], args) -> None:
    table = []
    for r in sorted(rows, key=lambda r: (r["length"], BENCH_METHODS.index(r["method"]))):
        dense = r["method"] == "dense"
        table.append([
            r["length"], r["method"], r["tokens_per_s"], "1.00" if dense else r.get("speedup_vs_dense", ""),
            r.get("tokens_per_cpu_s", ""), "1.00" if dense else r.get("cpu_speedup_vs_dense", ""), r["decode_s"], f"{100 * r['compress_share']:.1f}", mib(r["peak_kv_bytes"]),
            "" if dense else f"{100 * r['kv_reduction_vs_dense']:.1f}" if "kv_reduction_vs_dense" in r else "",
            r["retained_fraction"], r["peak_rss_mib"], r["peak_growth_mib"], r["max_batch_at_cap"],
        ])  # fmt: skip
    print(
        f"\n{args.model}, batch {args.batch}, budget {args.budget}, interval {args.interval}, window {args.window}, "
        f"{args.granularity}, fp32, {torch.get_num_threads()} thread(s); max batch at a {args.kv_cap_gib:g} GiB KV cap "
        "(computed from bytes per position and the bound)"
    )
    print_table(
        ["length", "method", "tok/s", "x dense", "tok/CPU-s", "x dense (CPU)", "decode s", "compress %", "peak KV MiB", "KV -% vs dense",
         "retained", "peak RSS MiB", "RSS growth MiB", "max batch"],
        table,
    )  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--batch", type=int, default=16, help="samples of the prompt per call")
    ap.add_argument("--lengths", type=lambda s: parse_list(int, s), default=DEFAULT_LENGTHS,
                    help="comma-separated generation lengths, run in this order (default 1024,2048,4096)")  # fmt: skip
    ap.add_argument("--methods", type=methods_arg, default=list(BENCH_METHODS),
                    help=f"comma-separated KV methods (default all: {','.join(BENCH_METHODS)})")  # fmt: skip
    ap.add_argument("--budget", type=int, default=512, help="KV budget (positions per sequence)")
    ap.add_argument("--interval", type=int, default=128, help="decode steps between compressions")
    ap.add_argument("--window", type=int, default=8, help="always-kept recent positions")
    ap.add_argument("--granularity", default="per_head", choices=["per_head", "shared"])
    ap.add_argument(
        "--kv-cap-gib", type=float, default=4.0, help="KV memory cap for the max-batch computation"
    )
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine, two threads' spin-waits "
                    "multiply step times under load)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick", action="store_true", help="batch 4, budget 64, interval 16, length 128, no JSON"
    )
    ap.add_argument("--resume", action="store_true", help="keep the runs already in --out (same settings)")
    ap.add_argument(
        "--redo",
        action="store_true",
        help="with --resume: run the given methods x lengths again, replacing them",
    )
    ap.add_argument("--out", default=None, help=f"JSON output (default {RESULTS / 'sparse_rollout.json'})")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.budget, args.interval, args.lengths = 4, 64, 16, [128]
    return args


def kv_for(method: str, args: argparse.Namespace) -> KVConfig | None:
    if method == "dense":
        return None
    return KVConfig(method=method, budget=args.budget, window=args.window, interval=args.interval,
                    granularity=args.granularity, seed=args.seed)  # fmt: skip


def build_report(args: argparse.Namespace, runs: list[dict], commands: list[str], measured: bool, settings: dict,
                 load_s: float) -> dict:  # fmt: skip
    """The results file: every run kept and measured with these settings, their summary and goals."""
    grid = {(m, n) for m in BENCH_METHODS for n in DEFAULT_LENGTHS}
    return {
        "benchmark": "sparse rollouts: dense KV vs eviction methods (sparserl RolloutEngine)",
        "command": command_line(),
        # every invocation that added runs
        "commands": [*dict.fromkeys([*commands, *([command_line()] if measured else [])])],
        "complete": grid <= {(r["method"], r["length"]) for r in runs},  # dense + every method at 1k/2k/4k
        "settings": settings,
        "dtype": "float32",
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "eos": "ignored"},
        "kv_cap_gib": args.kv_cap_gib,
        "max_batch_note": "computed: cap // (positions per sequence x bytes per position); positions = "
        "prompt + length (dense) or min(budget + interval - 1, prompt + length); every run's measured "
        "peak_kv_bytes equals batch x positions x bytes per position",
        "goals": goals_report(summarise(runs, args)),
        "goal_thresholds": GOALS,
        "model_load_s": load_s,
        "machine": machine_info(),
        "peak_rss_resettable": peak_is_resettable(),
        "runs": runs,
        "summary": summarise(runs, args),
    }


@stoppable("benchmarks/sparse_rollout.py", "results not written; run it again", exits=True)
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out_path = args.out or (None if args.quick else str(RESULTS / "sparse_rollout.json"))
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": PROMPT}])
    settings = settings_of(args, len(prompt))
    mine: list[dict] = []  # the runs this invocation measured

    def on_disk() -> tuple[list[dict], list[str]]:
        """Runs and commands already in --out with the same settings (re-read before every write, so that two
        `--resume` invocations on different methods or lengths can share one file)."""
        if not (args.resume and out_path and Path(out_path).is_file()):
            return [], []
        old = json.loads(Path(out_path).read_text())
        if old.get("settings") != settings:
            return [], []
        return old.get("runs", []), old.get("commands", [old["command"]] if "command" in old else [])

    def merged() -> tuple[list[dict], list[str]]:
        runs, commands = on_disk()
        key = {(r["method"], r["length"]) for r in mine}
        return [r for r in runs if (r["method"], r["length"]) not in key] + mine, commands

    if args.resume and out_path and Path(out_path).is_file():
        runs, _ = on_disk()
        print(f"resuming: {len(runs)} runs kept from {out_path}" if runs else f"not resuming: {out_path} has no "
              "runs with these settings")  # fmt: skip
        if args.redo:
            runs = [r for r in runs if not (r["method"] in args.methods and r["length"] in args.lengths)]
    else:
        runs = []
    done = {(r["method"], r["length"]) for r in runs}
    for method in args.methods:  # warm-up: first kernels, allocator, the methods' code paths
        kv = None if method == "dense" else KVConfig(method=method, budget=16, window=4, interval=4)
        run_one(model, tokenizer, kv, prompt, 2, 24, args.seed)

    for length in args.lengths:
        for method in args.methods:
            if (method, length) in done:
                continue
            res = run_one(model, tokenizer, kv_for(method, args), prompt, args.batch, length, args.seed)
            positions = held_positions(method, args, len(prompt), length)
            expected = args.batch * positions * res["kv_bytes_per_position"]
            assert res["peak_kv_bytes"] == expected, (method, length, res["peak_kv_bytes"], expected)
            mine.append({"method": method, "length": length, "positions_per_sequence": positions, **res})
            print(
                f"{method:>13} {length:>5}: {res['tokens_per_s']:.1f} tok/s, decode {res['decode_s']:.0f} s, "
                f"compress {100 * res['compress_share']:.1f}%, peak KV {mib(res['peak_kv_bytes']):.0f} MiB, "
                f"peak RSS {res['peak_rss_mib']:.0f} MiB (load {res['load_avg_1min_before']:.1f})",
                flush=True,
            )
            if out_path:
                write_json(out_path, build_report(args, *merged(), bool(mine), settings, load_s))
    final = build_report(args, *merged(), bool(mine), settings, load_s)
    print_report(final["summary"], args)
    if out_path:
        print(f"wrote {write_json(out_path, final)}")
    return final


if __name__ == "__main__":
    main()
