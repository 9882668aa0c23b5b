"""The rollout layer's scheduling under one KV memory cap, SmolLM2-135M, EOS ignored.

(a) Memory wall -> throughput: 4k-token generations of one prompt under `--cap-a`. Dense continuous batching,
    R-KV continuous batching and static batching (dense, every sequence charged prompt + 4096 positions up front)
    each decode as many sequences as the cap holds at once (one wave: the lengths are equal, so more waves
    would repeat it); completed tokens per CPU second and per wall second.
(b) A long-tailed length mix (lognormal per sample, `--median`, `--sigma`, clipped to [8, `--longest`]) under
    `--cap-b` with an R-KV cache: `--steps` rollout steps of `--groups` groups x `--n` samples through the
    rollout layer, for static batching, continuous batching, and continuous batching with APRIL at 2x
    over-provisioning (leftover samples continue at the next step; no training in between, so the weights do
    not change). Occupancy = mean fraction of the cap charged to running sequences per decode step; completed
    samples per CPU second.

    python benchmarks/scheduler.py            # both parts, ~70 min on 2 cores
    python benchmarks/scheduler.py --part b   # one part; --resume keeps the arms already in the JSON
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info, print_table, write_json  # noqa: E402

from sparserl.config.rollout import PartialConfig, RolloutConfig, parse_bytes  # noqa: E402
from sparserl.engine import KVConfig, RolloutEngine  # noqa: E402
from sparserl.engine.decoding import Request, Sampling  # noqa: E402
from sparserl.models import encode_prompt, load_model  # noqa: E402
from sparserl.rollout import (  # noqa: E402
    GroupSource,
    LeftoverBuffer,
    LocalBackend,
    RolloutLayer,
    Scheduler,
    SourceContext,
)
from sparserl.signals import stoppable  # noqa: E402

PROMPT = "Write a very long story about a lighthouse keeper who counts ships. Go on for as long as you can."
OUT = RESULTS / "scheduler.json"
GOALS = {
    "sparse_vs_dense_tokens_per_cpu_s": 3.0,
    "continuous_occupancy": 0.85,
    "april_samples_per_cpu_s_gain": 0.20,
}


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def rates(done: int, unit: str, start: tuple[float, float], end: tuple[float, float]) -> dict[str, float]:
    """Wall and CPU seconds between two `clock()` readings, and `done` per CPU second and per wall second."""
    wall, cpu = end[0] - start[0], end[1] - start[1]
    return {"wall_s": wall, "cpu_s": cpu, f"{unit}_per_cpu_s": done / cpu, f"{unit}_per_s": done / wall}


def part_a(model, tok, prompt: list[int], args) -> dict:
    """One wave of 4k-token sequences per arm: as many as the cap admits."""
    cap = parse_bytes(args.cap_a, "--cap-a")
    arms = {
        "dense_continuous": (None, "continuous"),
        "rkv_continuous": (KVConfig(method="rkv", budget=args.budget_a, interval=16), "continuous"),
        "static": (None, "static"),
    }
    out = {}
    for name, (kv, batching) in arms.items():
        engine = RolloutEngine(model, tok, kv)
        engine.eos_ids = set()
        scheduler = Scheduler(engine, cap, batching)
        probe = engine.start_run([Request(prompt, 0, 0, args.length)], Sampling(), kv_memory_cap=cap)
        rows = max(1, cap // probe.bytes_after_admit([0], whole=True))  # at the sequences' full length
        requests = [Request(prompt, key, 1, args.length) for key in range(rows)]
        start = clock()
        run, unfinished, stats = scheduler.run(requests, Sampling())
        end = clock()
        tokens = int((run.count - run.start_count).sum())
        out[name] = {
            "sequences": rows,
            "completed_tokens": tokens,
            **rates(tokens, "tokens", start, end),
            "peak_kv_bytes": run.peak_bytes,
            **stats.as_metrics(),
        }
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in out[name].items()}, flush=True)
    return out


def part_b(model, tok, prompt: list[int], args) -> dict:
    """`--steps` rollout steps per arm through the rollout layer, on a scripted long-tailed length mix."""
    rng = np.random.default_rng(0)
    rows = args.groups * args.steps * 3  # enough prompt rows for every arm (APRIL takes 2x per step)
    lengths = np.clip(rng.lognormal(np.log(args.median), args.sigma, (rows, args.n)), 8, args.longest).astype(
        int
    )
    kv = KVConfig(method="rkv", budget=args.budget_b, interval=16)
    arms = {
        "static": RolloutConfig(batching="static"),
        "continuous": RolloutConfig(),
        "continuous_april_2x": RolloutConfig(
            partial=PartialConfig(enable=True, over_provision=2.0, max_staleness=10)
        ),
    }
    out = {}
    for name, base in arms.items():
        cfg = RolloutConfig(
            prompts_per_step=args.groups, n=args.n, max_new_tokens=args.longest, kv_memory_cap=args.cap_b,
            batching=base.batching, async_rewards=False, partial=base.partial,
        )  # fmt: skip
        engine = RolloutEngine(model, tok, kv)
        engine.eos_ids = set()
        backend = LocalBackend(engine, cfg)
        layer = RolloutLayer(backend, _ScriptedTask(prompt), cfg)
        source = LeftoverBuffer(_ScriptedLengths(lengths, cfg.n), cfg.partial)
        start = clock()
        per_step = []
        samples = tokens = 0
        for step in range(args.steps):
            backend.push_weights(step)
            got = layer.collect(step, 1000 + step, source.plan(cfg.prompts_per_step, step))
            source.observe(got.groups, got.leftover)
            groups, metrics = got.groups, got.metrics
            samples += sum(len(g.samples) for g in groups)
            tokens += sum(len(s.tokens) for g in groups for s in g.samples)
            per_step.append({k: metrics[k] for k in ("occupancy", "kv_fill", "off_policy_token_frac",
                                                     "recycled_frac", "staleness_mean", "staleness_max",
                                                     "preemptions", "generated_tokens")})  # fmt: skip
        end = clock()
        layer.close()
        mean = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
        out[name] = {
            "completed_samples": samples,
            "completed_tokens": tokens,
            **rates(samples, "samples", start, end),
            **{f"{k}_mean": v for k, v in mean.items()},
            "staleness_max": max(m["staleness_max"] for m in per_step),
            "per_step": per_step,
        }
        print(name, {k: round(v, 3) for k, v in out[name].items() if isinstance(v, float)}, flush=True)
    return out


class _ScriptedTask:
    """One prompt for every row, no reward: the layer's task view in this benchmark."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt

    def prompt_ids(self, row: int) -> list[int]:
        return self.prompt

    def example(self, row: int) -> None:
        return None

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [""] * len(ids)

    def scores(self, texts: list[str], examples: list) -> list[float]:
        return [0.0] * len(texts)


class _ScriptedLengths(GroupSource):
    """Rows 0, 1, 2... in order; sample j of row r runs exactly lengths[r, j] tokens (EOS is off)."""

    def __init__(self, lengths, n: int) -> None:
        super().__init__(SourceContext(rows=[], n=n, seed=0))
        self.lengths, self.position = lengths, 0

    def choose(self, k: int, version: int) -> list[int]:
        self.position += k
        return list(range(self.position - k, self.position))

    def plan(self, k: int, version: int):
        plans = super().plan(k, version)
        for p in plans:
            p.max_new_tokens = [int(self.lengths[p.row, j]) for j in range(p.n)]
        return plans


def goals(a: dict, b: dict) -> dict:
    """One entry per scheduler goal, each with the command that measured its part."""
    g = {}
    if a:
        ratio = a["rkv_continuous"]["tokens_per_cpu_s"] / a["dense_continuous"]["tokens_per_cpu_s"]
        g["sparse_vs_dense_tokens_per_cpu_s"] = {
            "value": round(ratio, 3),
            "target": GOALS["sparse_vs_dense_tokens_per_cpu_s"],
        }
    if b:
        occ = b["continuous"]["occupancy_mean"]
        gain = b["continuous_april_2x"]["samples_per_cpu_s"] / b["continuous"]["samples_per_cpu_s"] - 1
        g["continuous_occupancy"] = {"value": round(occ, 3), "target": GOALS["continuous_occupancy"]}
        g["april_samples_per_cpu_s_gain"] = {
            "value": round(gain, 3),
            "target": GOALS["april_samples_per_cpu_s_gain"],
        }
    for name, v in g.items():
        v["met"] = v["value"] >= v["target"]
        v["command"] = (a if name.startswith("sparse") else b)["command"]
    return g


@stoppable("benchmarks/scheduler.py", "results not written; run it again", exits=True)
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["a", "b", "both"], default="both")
    p.add_argument("--cap-a", default="256MiB")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget-a", type=int, default=512)
    p.add_argument("--cap-b", default="64MiB")
    p.add_argument("--budget-b", type=int, default=128)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--median", type=float, default=64)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--longest", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="keep the parts already in the JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m")
    prompt = encode_prompt(tok, [{"role": "user", "content": PROMPT}])
    import json

    old = json.loads(OUT.read_text()) if args.resume and OUT.is_file() else {}
    a = old.get("a", {}) if args.part == "b" or (args.resume and old.get("a")) else {}
    b = old.get("b", {}) if args.part == "a" or (args.resume and old.get("b")) else {}
    for part, name in ((a, "sparse_vs_dense_tokens_per_cpu_s"), (b, "continuous_occupancy")):
        if part and "command" not in part:  # measured before parts recorded their own command
            part["command"] = old["goals"][name]["command"]
    with torch.no_grad():
        if args.part in ("a", "both") and not a:
            a = {**part_a(model, tok, prompt, args), "command": command_line()}
            write_json(OUT, {"a": a, "b": b})  # partial result, so an interruption keeps part a
        if args.part in ("b", "both") and not b:
            b = {**part_b(model, tok, prompt, args), "command": command_line()}
    payload = {
        "goals": goals(a, b),
        "settings": vars(args),
        "machine": machine_info(),
        "a": a,
        "b": b,
    }
    write_json(OUT, payload)
    arms_a = {k: v for k, v in a.items() if isinstance(v, dict)}
    arms_b = {k: v for k, v in b.items() if isinstance(v, dict)}
    if arms_a:
        print_table(["arm", "seqs", "tok/cpu-s", "tok/s", "occupancy"],
                    [[k, v["sequences"], v["tokens_per_cpu_s"], v["tokens_per_s"], v["occupancy"]] for k, v in arms_a.items()])  # fmt: skip
    if arms_b:
        print_table(["arm", "samples/cpu-s", "occupancy", "kv_fill", "off-policy"],
                    [[k, v["samples_per_cpu_s"], v["occupancy_mean"], v["kv_fill_mean"], v["off_policy_token_frac_mean"]] for k, v in arms_b.items()])  # fmt: skip
    print(payload["goals"])


if __name__ == "__main__":
    main()
