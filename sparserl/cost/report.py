"""`sparserl cost`: the cost model's predictions as a table (or JSON), the intensity probe, and the check of the
model against the engine's measured decode steps."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from typing import Any

from sparserl.cost.model import Cost, Estimate, Rollout, estimate
from sparserl.cost.probe import check_timing_request, probe_intensity, resolve_intensity, time_decode_steps
from sparserl.cost.shape import (
    CostInputError,
    ModelShape,
    load_model_config,
    shape_from_config,
    torch_dtype,
)
from sparserl.engine.kv_config import KVConfig
from sparserl.errors import UserError
from sparserl.sizes import size_in_bytes


def parse_size(text: str) -> int:
    """Bytes in a human size: '4GiB', '512 MiB', '8GB' (powers of 1000), '4G' (powers of 1024), '1000'."""
    try:
        size = size_in_bytes(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise CostInputError(f"--mem-cap {text!r} is not a positive size such as 4GiB, 512MiB or 8GB")
    return size


def parse_int_list(text: str, flag: str) -> list[int]:
    """'0,1' -> [0, 1]; an empty string is an empty list."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise CostInputError(f"{flag} {text!r} must be comma-separated integers") from err


def kv_configs(args: argparse.Namespace) -> list[KVConfig]:
    """One KV policy per `--methods` entry, dense first (the baseline of every ratio); under `--kv-quant`, a
    quantized dense row and every other entry quantized after the full-precision dense baseline."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    quant = getattr(args, "kv_quant", "none")
    rest = ["dense"] * (quant != "none") + [m for m in methods if m != "dense"]
    methods = [("dense", "none"), *((m, quant) for m in rest)]
    dense_layers = parse_int_list(args.dense_layers, "--dense-layers")
    try:
        return [
            KVConfig(
                method=method,
                quant=quant,
                budget=args.budget,
                schedule=args.schedule,
                interval=args.interval,
                page_size=args.page_size,
                dense_layers=dense_layers,
            )
            for method, quant in methods
        ]
    except UserError as e:  # a flag's value (--budget, --schedule, ...) that no KV policy takes
        raise CostInputError(str(e)) from None


def method_row(est: Estimate, dense: Estimate, intensity: float, mem_cap: int) -> dict[str, Any]:
    """One method's predictions, its ratios to dense, and its cost components."""
    effective = est.total.effective(intensity)
    return {
        "method": est.method,
        "budget": est.budget,
        "mean_positions_read": est.mean_positions_read,
        "positions_held": est.positions_held,
        "flops": est.total.flops,
        "bytes": est.total.bytes,
        "effective_flops": effective,
        "speedup_vs_dense": dense.total.effective(intensity) / effective,
        "decode_speedup_vs_dense": dense.decode.effective(intensity) / est.decode.effective(intensity),
        "bytes_per_sequence": est.bytes_per_sequence,
        "sequences_at_mem_cap": est.sequences_fitting(mem_cap),
        "prefill": asdict(est.prefill),
        "decode": asdict(est.decode),
    }


def shape_summary(shape: ModelShape) -> dict[str, Any]:
    return {
        **asdict(shape),
        "token_params": shape.token_params,
        "total_params": shape.total_params,
        "kv_bytes_per_position": shape.kv_bytes_per_position,
    }


def predict(args: argparse.Namespace, shape: ModelShape, context: int | None = None) -> dict[str, Any]:
    """The report of `sparserl cost`: every method's cost for one rollout, relative to dense (a rollout past
    the model's `context` is refused)."""
    rollout = Rollout(args.prompt_len, args.output_len, args.n)
    intensity, mem_cap = resolve_intensity(args.intensity), parse_size(args.mem_cap)
    kvs = kv_configs(args)
    for kv in kvs:  # each method's settings against the model first, on a one-token rollout (cheap)
        estimate(shape, Rollout(args.prompt_len, 1, args.n), kv)
    check_context(context, args.prompt_len, args.output_len)
    estimates = [estimate(shape, rollout, kv) for kv in kvs]
    return {
        "model": shape_summary(shape),
        "rollout": asdict(rollout),
        "intensity": intensity,
        "intensity_source": args.intensity,
        "mem_cap_bytes": mem_cap,
        "methods": [method_row(est, estimates[0], intensity, mem_cap) for est in estimates],
    }


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def render_prediction(report: dict[str, Any]) -> str:
    """The human-readable form of `predict`'s report."""
    model, rollout = report["model"], report["rollout"]
    intro = (
        f"model {model['name']}: {model['token_params'] / 1e6:.1f}M weights per token, {model['layers']} layers, "
        f"{model['kv_bytes_per_position']} KV bytes per position ({model['dtype_bytes']}-byte dtype)\n"
        f"rollout: {rollout['n']} samples x ({rollout['prompt_len']} prompt + {rollout['output_len']} new) "
        f"tokens; I = {report['intensity']:.3g} FLOP/byte ({report['intensity_source']}); "
        f"KV memory cap {report['mem_cap_bytes'] / 2**30:.2f} GiB\n"
    )
    header = ["method", "budget", "read/step", "held/seq", "GFLOP", "GB moved", "eff. TFLOP", "speed-up",
              "decode speed-up", "KV MiB/seq", "seqs at cap"]  # fmt: skip
    rows = [
        [
            m["method"],
            m["budget"],
            f"{m['mean_positions_read']:.0f}",
            str(m["positions_held"]),
            f"{m['flops'] / 1e9:.1f}",
            f"{m['bytes'] / 1e9:.2f}",
            f"{m['effective_flops'] / 1e12:.3f}",
            f"{m['speedup_vs_dense']:.2f}x",
            f"{m['decode_speedup_vs_dense']:.2f}x",
            f"{m['bytes_per_sequence'] / 2**20:.1f}",
            str(m["sequences_at_mem_cap"]),
        ]
        for m in report["methods"]
    ]
    return intro + format_table(header, rows)


def implied_intensity(base: Cost, other: Cost, measured_ratio: float) -> float | None:
    """The I at which the model's ratio other/base equals the measured one (None if no positive I does)."""
    denominator = measured_ratio * base.bytes - other.bytes
    value = (other.flops - measured_ratio * base.flops) / denominator if denominator else -1.0
    return value if value > 0 else None


def timed_steps_estimate(shape: ModelShape, prompt_len: int, steps: int, batch: int, kv: KVConfig) -> Cost:
    """The cost model's estimate of the decode steps that `time_decode_steps` clocks: those at contexts
    prompt_len + 2 ... prompt_len + steps - 1."""
    return estimate(shape, Rollout(prompt_len + 1, steps - 1, batch), kv).decode


def check_decode(args: argparse.Namespace, shape: ModelShape) -> dict[str, Any]:
    """Time the engine's decode steps for every `--methods` entry at each `--probe-decode` prompt length and
    compare with the cost model: each cell's step time relative to dense at the first length (CPU and wall),
    and each method's speed-up over dense at the same length, measured (CPU) and predicted."""
    from sparserl.models import load_model

    lengths = parse_int_list(args.probe_decode, "--probe-decode")
    if getattr(args, "kv_quant", "none") != "none":
        raise CostInputError("--probe-decode times full-precision caches only: drop --kv-quant")
    intensity, kvs = resolve_intensity(args.intensity), kv_configs(args)
    check_timing_request(lengths, args.decode_steps, args.repeats)
    model, tokenizer = load_model(args.model, dtype=torch_dtype(args.dtype))
    times = time_decode_steps(
        model, tokenizer, lengths, kvs, args.n, args.decode_steps, args.threads, args.repeats
    )
    predicted = {
        (kv.method, length): timed_steps_estimate(shape, length, args.decode_steps, args.n, kv)
        for kv in kvs
        for length in lengths
    }
    cpu = {cell: statistics.median(t.cpu) for cell, t in times.items()}
    wall = {cell: statistics.median(t.wall) for cell, t in times.items()}
    base = ("dense", lengths[0])
    rows = []
    for method, length in times:
        cell, dense = (method, length), ("dense", length)
        model_ratio = predicted[cell].effective(intensity) / predicted[base].effective(intensity)
        rows.append(
            {
                "method": method,
                "prompt_len": length,
                "mean_context": length + (args.decode_steps + 1) / 2,
                **asdict(times[cell]),
                "measured_cpu_ratio": cpu[cell] / cpu[base],
                "measured_wall_ratio": wall[cell] / wall[base],
                "predicted_ratio": model_ratio,
                "prediction_error": model_ratio / (cpu[cell] / cpu[base]) - 1,
                "implied_intensity": implied_intensity(
                    predicted[base], predicted[cell], cpu[cell] / cpu[base]
                ),
                "measured_speedup_vs_dense": cpu[dense] / cpu[cell],
                "predicted_speedup_vs_dense": predicted[dense].effective(intensity)
                / predicted[cell].effective(intensity),
            }
        )
    return {
        "model": args.model,
        "batch": args.n,
        "threads": args.threads,
        "intensity": intensity,
        "rows": rows,
    }


def render_decode_check(report: dict[str, Any]) -> str:
    """The human-readable form of `check_decode`'s report."""
    header = ["method", "prompt", "mean context", "CPU s/step", "wall s/step", "ratio CPU", "ratio wall",
              "ratio model", "model error", "implied I", "speed-up CPU", "speed-up model"]  # fmt: skip
    rows = [
        [
            r["method"],
            str(r["prompt_len"]),
            f"{r['mean_context']:.0f}",
            f"{statistics.median(r['cpu']):.4f}",
            f"{statistics.median(r['wall']):.4f}",
            f"{r['measured_cpu_ratio']:.3f}",
            f"{r['measured_wall_ratio']:.3f}",
            f"{r['predicted_ratio']:.3f}",
            f"{r['prediction_error']:+.1%}",
            "-" if r["implied_intensity"] is None else f"{r['implied_intensity']:.2f}",
            f"{r['measured_speedup_vs_dense']:.2f}x",
            f"{r['predicted_speedup_vs_dense']:.2f}x",
        ]
        for r in report["rows"]
    ]
    intro = (
        f"decode steps of {report['model']}, batch {report['batch']}, {report['threads']} thread(s), medians "
        f"of the repeats; ratios to dense at the first length; model with I = {report['intensity']:.3g}\n"
    )
    return intro + format_table(header, rows)


def model_spec(model: str) -> str:
    """The model a `--model` names: a training run directory stands for the model it trains (same shape)."""
    from sparserl.eval.loading import is_run_dir, run_config

    return run_config(model).model.spec if is_run_dir(model) else model


def check_context(context: int | None, prompt_len: int, output_len: int) -> None:
    """The rollout fits the model's `context` (the model says nothing of longer ones, and their cost grows
    without end); CostInputError naming the flags otherwise."""
    if context and prompt_len + output_len > context:
        raise CostInputError(
            f"--prompt-len {prompt_len} + --output-len {output_len} = {prompt_len + output_len:,} tokens is "
            f"beyond the model's context of {context:,} positions"
        )


def cost_command(args: argparse.Namespace) -> int:
    """`sparserl cost`: predict (default), `--probe` the intensity, or `--probe-decode` to check the model."""
    spec = model_spec(args.model)
    config = load_model_config(spec)
    shape = shape_from_config(config, spec, args.dtype)
    if args.probe:
        probe = probe_intensity(shape, batch=args.n, threads=args.threads, dtype=args.dtype)
        report: dict[str, Any] = asdict(probe)
        text = (
            f"{args.threads} thread(s), {args.dtype}, batch {args.n}: matmul "
            f"{probe.matmul_flops_per_s / 1e9:.1f} GFLOP/s, read {probe.read_bytes_per_s / 1e9:.2f} GB/s "
            f"(copy {probe.copy_bytes_per_s / 1e9:.2f} GB/s) -> I = {probe.intensity:.2f} FLOP/byte"
        )
    elif args.probe_decode:
        report = check_decode(args, shape)
        text = render_decode_check(report)
    else:
        report = predict(args, shape, getattr(config, "max_position_embeddings", None))
        text = render_prediction(report)
    print(json.dumps(report, indent=2) if args.json else text)
    return 0
