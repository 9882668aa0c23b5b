"""How close is a decode step to its weight matmuls, and when does compiling it pay? SmolLM2-135M, fp32, one
thread by default, dense and R-KV (the default run's KV: budget 80, interval 16, window 8).

For each KV method and batch size (8, 16, 32 and 64): the engine's decode step (one random prompt of `--prompt-len` tokens x batch,
`--steps` new tokens, EOS ignored; CPU seconds per step clocked between the engine's step callbacks, so the
prefill is left out: `sparserl.cost.probe.time_decode_steps`), and the same model's weight matmuls alone at that
batch, on random inputs, the same weights, two ways: the engine's packed matrices (q|k|v and gate|up fused,
stored [in, out]: `sparserl.engine.weights`), and every projection and the LM head as `F.linear` over the
module's [out, in] weight. Arms alternate, `--repeats` times; medians. The ratio step / packed matmuls (the
fastest matmuls known here, so the goal's reference) is what a step costs beyond the matmuls it cannot avoid:
attention, norms, RoPE, sampling and Python. Two arms: the eager step and `engine.compile=true` (torch.compile,
static shapes; compiled once per batch before its steps are clocked). The compile's own cost is clocked too
(CPU seconds of the first compiled call minus a later one, with an empty compile cache: `TORCHINDUCTOR_CACHE_DIR`
points at a fresh folder unless `--warm-cache`), and with the step saved it gives each configuration's
break-even: the decode steps a run needs before the compile has paid (engine.compile=auto's rule,
sparserl/engine/rollout.py). `--profile` adds the eager step's top operators (torch.profiler, self CPU time).

    python benchmarks/decode_step.py --profile     # writes docs/results/decode_step.json
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info, write_json

from sparserl.cost.probe import time_decode_steps
from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.decoder import causal_lm
from sparserl.engine.weights import PackedProjections
from sparserl.models import load_model
from sparserl.signals import stoppable

GOALS = {
    16: 1.3,
    64: 1.3,
}  # the most a compiled step may cost, in weight-matmul times, per batch size
RKV = KVConfig(method="rkv", budget=80, interval=16, window=8)  # configs/default.yaml's
# decode steps of a run of each measured configuration (trainer.steps x rollout.max_new_tokens, batch)
RUNS = {
    "default sparserl train (R-KV, 8 steps x 64 tokens, batch 32)": ("rkv", 32, 8 * 64),
    "benchmarks/rl_step.py (dense, 4 steps x 64 tokens, batch 8)": ("dense", 8, 4 * 64),
    "benchmarks/decode_step.py batch 16 (dense, 24 steps)": ("dense", 16, 24),
}


def compile_seconds(model, tokenizer, kv: KVConfig, batch: int, prompt_len: int) -> float:
    """CPU seconds the first compiled call at this shape spends compiling (that call minus the next, 4 tokens)."""
    engine = RolloutEngine(model, tokenizer, kv=kv, compile=True)
    engine.eos_ids = set()
    prompt = torch.randint(tokenizer.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    cpu = []
    for _ in range(2):
        start = time.process_time()
        engine.generate([prompt.tolist()], n=batch, max_new_tokens=4, seed=0)
        cpu.append(time.process_time() - start)
    return cpu[0] - cpu[1]


def weight_matrices(model) -> list[torch.Tensor]:
    """The matrices one decode step multiplies by: per layer q, k, v, o, gate, up, down, then the LM head."""
    lm = causal_lm(model)
    out = []
    for layer in lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
        out += [m.weight for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    return [*out, lm.lm_head.weight]


def packed_matrices(model) -> list[torch.Tensor]:
    """The engine's own packed [in, out] matrices, in the order a step multiplies by them."""
    lm = causal_lm(model)
    packed = PackedProjections.build(lm.model.layers, lm.lm_head, lm.lm_head.weight.dtype)
    per_layer = zip(packed._qkv, packed._out, packed._gate_up, packed._down, strict=True)
    return [m.weight_t for group in per_layer for m in group] + [packed._lm_head.weight_t]


def matmul_seconds(weights: list[torch.Tensor], batch: int, passes: int, packed: bool) -> float:
    """CPU seconds of one pass over every weight at `batch` rows (median of `passes`): `torch.mm` by an
    [in, out] matrix when `packed`, else `F.linear` by an [out, in] one."""
    fan_in = [w.shape[0] if packed else w.shape[1] for w in weights]
    inputs = {i: torch.randn(batch, i, dtype=weights[0].dtype) for i in fan_in}
    times = []
    for _ in range(passes + 1):  # the first pass warms up
        start = time.process_time()
        for w, i in zip(weights, fan_in, strict=True):
            torch.mm(inputs[i], w) if packed else F.linear(inputs[i], w)
        times.append(time.process_time() - start)
    return statistics.median(times[1:])


def profile_step(model, tokenizer, batch: int, prompt_len: int, steps: int, top: int) -> list[dict]:
    """The top operators of the eager decode steps 2 .. `steps` - 1 by self CPU time, as shares of their total."""
    from torch.profiler import ProfilerActivity, profile

    engine = RolloutEngine(model, tokenizer)
    engine.eos_ids = set()
    prompt = torch.randint(tokenizer.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0))
    prof = profile(activities=[ProfilerActivity.CPU])
    # decode steps only: from the end of the first step to the end of the last (no weight packing, no prefill)
    window = lambda step, *_: prof.start() if step == 0 else prof.stop() if step == steps - 2 else None  # noqa: E731
    with engine.step_hook(window):
        engine.generate([prompt.tolist()], n=batch, max_new_tokens=steps, seed=0)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in events[:top]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument(
        "--batches", default="8,16,32,64", help="batch sizes, comma-separated (default 8,16,32,64)"
    )
    ap.add_argument("--methods", default="dense,rkv", help="KV methods: dense, rkv (default both)")
    ap.add_argument("--prompt-len", type=int, default=100, help="prompt tokens (default 100)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per timing (default 24)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating timings per batch (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--profile", action="store_true", help="also profile the step's top operators")
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out the engine.compile=true arm (its first call per shape compiles, ~40 s)")  # fmt: skip
    ap.add_argument("--warm-cache", action="store_true",
                    help="keep torch's compile cache (default: a fresh one, so the compile cost is the cold one)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_step.json", help="JSON output")
    return ap.parse_args()


@stoppable("benchmarks/decode_step.py", "results not written; run it again", exits=True)
def main() -> None:
    args = parse_args()
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="decode_step_inductor_")
    batches = [int(b) for b in args.batches.split(",")]
    kvs = {"dense": KVConfig(), "rkv": RKV}
    methods = args.methods.split(",")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    weights, packed = weight_matrices(model), packed_matrices(model)
    arms = ["eager"] + ([] if args.no_compile else ["compiled"])
    compile_s = {}
    if not args.no_compile:
        for m in methods:
            for b in batches:
                compile_s[m, b] = compile_seconds(model, tokenizer, kvs[m], b, args.prompt_len)
                print(f"{m} batch {b}: compile {compile_s[m, b]:.1f} CPU-s", flush=True)
    step_s = {(m, arm, b): [] for m in methods for arm in arms for b in batches}
    matmul_s: dict[int, list[float]] = {b: [] for b in batches}
    linear_s: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(args.repeats):
        for b in batches:
            for m in methods:
                for arm in arms:
                    t = time_decode_steps(model, tokenizer, [args.prompt_len], [kvs[m]], b, args.steps,
                                          args.threads, 1, compile=arm == "compiled")  # fmt: skip
                    step_s[m, arm, b] += t[kvs[m].method, args.prompt_len].cpu
            matmul_s[b].append(matmul_seconds(packed, b, args.steps, packed=True))
            linear_s[b].append(matmul_seconds(weights, b, args.steps, packed=False))
    rows, goals = [], {}
    for m in methods:
        for b in batches:
            matmuls, linear = statistics.median(matmul_s[b]), statistics.median(linear_s[b])
            row = {"method": m, "batch": b, "matmul_cpu_s": matmuls, "linear_matmul_cpu_s": linear,
                   "matmul_cpu_s_runs": matmul_s[b], "linear_matmul_cpu_s_runs": linear_s[b]}  # fmt: skip
            for arm in arms:
                step = statistics.median(step_s[m, arm, b])
                row[arm] = {"step_cpu_s": step, "ratio": step / matmuls, "ratio_to_linear": step / linear,
                            "tokens_per_cpu_s": b / step, "step_cpu_s_runs": step_s[m, arm, b]}  # fmt: skip
                print(f"{m:>5} batch {b:>3} {arm:>8}: step {1000 * step:.1f} ms CPU, packed weight matmuls "
                      f"{1000 * matmuls:.1f} ms (F.linear {1000 * linear:.1f} ms), ratio {step / matmuls:.2f}", flush=True)  # fmt: skip
                if b in GOALS and arm == "compiled":
                    name = f"Decode at batch {b}, {m}, compiled, {args.threads} thread(s), within {GOALS[b]}x of its weight matmuls"
                    met = step / matmuls <= GOALS[b]
                    goals[name] = {"value": step / matmuls, "target": GOALS[b], "met": met, "command": command_line(),
                                   "reason": "met" if met else "not met: beyond the matmuls the step still pays "
                                   "attention over the cache, norms, RoPE, sampling and the per-call Python of "
                                   "~30 layers (the eager/compiled ratios in rows say how much compiling removed)"}  # fmt: skip
            if "compiled" in arms:
                saved = row["eager"]["step_cpu_s"] - row["compiled"]["step_cpu_s"]
                row["compile_cpu_s"] = compile_s[m, b]
                row["saved_per_step_cpu_s"] = saved
                row["break_even_steps"] = compile_s[m, b] / saved if saved > 0 else None
            if args.profile:
                row["eager"]["profile"] = profile_step(
                    model, tokenizer, b, args.prompt_len, args.steps, top=12
                )
            rows.append(row)
    break_even = {}
    for name, (m, b, steps) in RUNS.items():
        row = next((r for r in rows if r["method"] == m and r["batch"] == b and "compile_cpu_s" in r), None)
        if row is not None:
            even = row["break_even_steps"]
            break_even[name] = {"decode_steps": steps, "break_even_steps": even,
                                "pays": even is not None and steps >= even}  # fmt: skip
    write_json(args.out, {
        "benchmark": "decode step vs its weight matmuls alone, eager and compiled, and the compile's break-even "
        "(sparserl RolloutEngine)",
        "command": command_line(), "model": args.model, "dtype": "float32", "threads": args.threads,
        "prompt_len": args.prompt_len, "steps": args.steps, "repeats": args.repeats, "methods": methods,
        "rkv": {"budget": RKV.budget, "interval": RKV.interval, "window": RKV.window},
        "compile_cache": "warm" if args.warm_cache else "cold (a fresh TORCHINDUCTOR_CACHE_DIR)",
        "goals": goals, "break_even": break_even, "machine": machine_info(), "rows": rows,
    })  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
