"""One RL step: sparserl's `sparserl train` vs TRL's GRPOTrainer, same model, prompts and settings, side by side.

Both arms train SmolLM2-135M (full fine-tuning) on the built-in arithmetic task of the default config (the same
chat messages, the same prompt at each step, the task's own verifiable reward), 1 prompt x `--n` samples per
step, up to `--max-new-tokens` new tokens, temperature 1, top-p 1, no top-k, dense rollouts (sparserl's `dense`
preset), learning rate `--lr`, the same AdamW settings, KL weight `--kl-coef` (k3) on both, `--threads` torch
threads each. Each arm runs in its own process (threads and memory do not leak between arms), the arms
alternate (trl, sparserl, sparserl-compiled, then again for `--repeats 2`; sparserl-compiled is `sparserl train
engine.compile=true`, whose first step compiles), and every step is recorded with its wall and CPU
seconds, its split into rollout, scoring and update, and its completion tokens per second. The time per step
of an arm is the median of its steps after the first `--warmup-steps` over all repeats; the goal is TRL's over
sparserl's. How each part is measured on each side and every remaining difference are in the JSON.

    pip install -e .[bench]                      # TRL 1.16.0: a benchmark-only extra, never imported by sparserl
    python benchmarks/rl_step.py                 # 4 steps x 2 repeats per arm at 2 threads -> docs/results/rl_step.json
    python benchmarks/rl_step.py --dtype bfloat16 --arms trl,sparserl   # bf16 -> docs/results/rl_step_bf16.json
    python benchmarks/rl_step.py --quick --threads 1   # 1 step of 8 new tokens per arm, a temp file: a smoke run
    python benchmarks/rl_step.py --arms trl,sparserl,sparserl-overlap --resume   # the overlapped arm (rollout.overlap)
    python benchmarks/rl_step.py --arms trl,sparserl-overlap,sparserl-overlap-glibc --resume   # + glibc's threshold

Each finished arm run is written to the JSON at once (`"complete": false` until the end); `--resume` keeps the
(arm, repeat) runs already in it when the settings match.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    GPU_GOAL,
    GPU_GOAL_TARGET,
    REPO,
    RESULTS,
    command_line,
    machine_info,
    merge_runs_and_write,
    print_table,
    runs_with_settings,
)
from rl_step_trl import print_step, step_row, trl_child, trl_config_kwargs  # noqa: E402

from sparserl.signals import stoppable  # noqa: E402

TRL_VERSION = "1.16.0"
ARMS = ("trl", "sparserl", "sparserl-compiled", "sparserl-overlap", "sparserl-overlap-glibc")
ARM_KEYS = {  # engine.compile=true; rollout.overlap; the same with glibc's own mmap threshold (as TRL's process has)
    "sparserl-compiled": ["engine.compile=true"],
    "sparserl-overlap": ["rollout.overlap.enable=true"],
    "sparserl-overlap-glibc": ["rollout.overlap.enable=true", "trainer.malloc_mmap_threshold=0"],
}
OVERLAP_GOAL, OVERLAP_STRETCH = 2.5, 3.0  # the overlapped arm's goal and stretch (TRL's wall over sparserl's)
GOAL = 2.0
MISSING_TRL = f"rl_step: TRL is not installed; `pip install -e .[bench]` (trl=={TRL_VERSION}) adds it"

MEASURED = {
    "step": "trl: TrainerCallback on_step_begin -> on_step_end (perf_counter and time.process_time, all threads of "
    "the process); sparserl: metrics time/step (rollout + learn; metrics logging and checkpoints are outside)",
    "rollout": "trl: seconds inside the policy's `generate` calls (the model's generate method wrapped); "
    "sparserl: time/rollout (prompt lookup + RolloutEngine.generate)",
    "scoring": "trl: GRPOTrainer._generate_and_score_completions minus its generate calls (prompt chat template "
    "and tokenisation, padding, decoding, reward, advantages, reference log-probs); sparserl: time/reward + "
    "time/score (decoding, reward, advantages, reference log-probs)",
    "update": "trl: step minus _generate_and_score_completions (loss forward/backward, clipping, AdamW, "
    "scheduler); sparserl: time/train (Learner.update)",
    "cpu_s": "both: time.process_time() over the step (all threads of the process); sparserl logs it as "
    "time/step_cpu",
    "completion_tokens_per_s": "sum of the step's completion lengths (EOS included) / step wall seconds",
}

DIFFERENCES = [
    "sampler: sparserl's RolloutEngine prefills the prompt once per group, decodes in a preallocated KV cache "
    "and drops finished samples; TRL calls transformers `generate` on n copies of the prompt (n prefills), and "
    "finished rows keep decoding as padding until the longest one ends (the implementations being compared)",
    "random draws: sparserl draws per-sample uniforms seeded by (seed, step), TRL torch's global generator (seed "
    "0): the completions and their lengths differ between arms (tokens per second partly normalises this)",
    "reference policy (kl_coef > 0): sparserl deep-copies the initial weights in memory, TRL loads a second copy "
    "from the model folder (start-up only); KL: both k3, sparserl clamps the per-token estimate to +-10 "
    "(algo.kl_clamp) and log-ratios to +-20 before exp (algo.log_ratio_clamp), TRL clamps neither",
    "the TRL learner forward also computes per-token entropies (logged; GRPOTrainer always asks for them); "
    "sparserl computes entropy only with algo.entropy_coef > 0",
    "optimizer: both run torch's fused AdamW (TRL: transformers' adamw_torch_fused; sparserl: fused=True) with the "
    "same hyperparameters (betas, eps, weight decay on >= 2-D weights, clipping, constant lr)",
    "gradient checkpointing is off on both (TRL's default is on; sparserl has none): the benchmark gives each "
    "arm its fastest math-preserving choices",
    "step boundaries: TRL's step excludes fetching the raw prompt from its dataloader and its per-step logging, "
    "sparserl's its metrics logging; the prompt's chat template and tokenisation count in sparserl's rollout "
    "and in TRL's scoring",
    "safety checks only sparserl makes: NaN/inf checks of the learner's log-probs per micro-batch and of every "
    "weight after each optimizer step (skip or stop), and the step's correction metrics (zero weight in the "
    "dense preset's loss)",
]

BF16_DIFFERENCES = [
    "bfloat16: both arms keep float32 master weights and AdamW state (the model is loaded in float32). sparserl "
    "samples from a bfloat16 copy of the weights with a bfloat16 KV cache and runs scoring and the learner "
    "under CPU autocast; TRL's bf16=True runs the Trainer's forward passes under CPU autocast",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from sparserl.algo import algo_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--steps", type=int, default=4, help="training steps per arm run (default 4)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating trl/sparserl")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (and OMP_NUM_THREADS) of each arm")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group size); 1 prompt per step")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=64, help="completion length cap")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of both arms")
    ap.add_argument("--kl-coef", type=float, default=algo_config("dense").kl_coef,
                    help="KL weight (k3) of both arms; default: sparserl's dense preset (TRL: beta). 0 drops "
                    "the reference model on both")  # fmt: skip
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="micro-batches per step on both (TRL: gradient_accumulation_steps, n / this per device)")  # fmt: skip
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype of both arms (bfloat16: float32 master weights; TRL with bf16=True)")  # fmt: skip
    ap.add_argument("--warmup-steps", type=int, default=1,
                    help="first steps of each run left out of the medians (default 1: medians of steps 2..N)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="training seed of both arms")
    ap.add_argument("--arms", default="trl,sparserl,sparserl-compiled", help="comma-separated arms, run in this order per repeat: trl, sparserl, sparserl-compiled (engine.compile=true), sparserl-overlap (rollout.overlap.enable=true), sparserl-overlap-glibc (the same, trainer.malloc_mmap_threshold=0)")  # fmt: skip
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 step of 8 new tokens, 1 repeat, JSON to a temp file (not docs/results)")  # fmt: skip
    ap.add_argument("--resume", action="store_true", help="keep the (arm, repeat) runs already in --out (same settings)")  # fmt: skip
    ap.add_argument("--out", default=None,
                    help=f"JSON output (default {RESULTS / 'rl_step.json'}, rl_step_bf16.json for bfloat16)")  # fmt: skip
    ap.add_argument("--child", choices=["trl"], default=None, help="internal: run one TRL arm in this process")  # fmt: skip
    ap.add_argument("--spec", default=None, help="internal: the child's settings (JSON written by the parent)")  # fmt: skip
    ap.add_argument("--child-out", default=None, help="internal: where the child writes its per-step rows")
    args = ap.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    if not args.arms or set(args.arms) - set(ARMS):
        ap.error(f"--arms: choose from {', '.join(ARMS)}")
    if args.quick:
        args.steps, args.max_new_tokens, args.repeats = 1, 8, 1
    if args.n % args.grad_accum:
        ap.error(f"--grad-accum {args.grad_accum} must divide --n {args.n}")
    return args


def sparserl_overrides(args: argparse.Namespace, output_dir: str = "", run_name: str = "") -> list[str]:
    """`sparserl train` overrides of the benchmark's setting (on the embedded default config: its task, system
    prompt, AdamW betas/weight decay/clipping). TRL's settings are derived from the same resolved config."""
    out = [
        f"model.spec={args.model}", "model.lora=false", f"model.dtype={args.dtype}",
        "rollout.prompts_per_step=1", f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        "rollout.top_k=0", "kv.method=dense", "algo.preset=dense", f"algo.kl_coef={args.kl_coef}",
        "algo.kl_estimator=k3", "algo.adv_eps=1e-4",  # TRL divides by std + 1e-4
        f"optim.lr={args.lr}", "optim.schedule=constant", "optim.warmup_steps=0", "optim.mini_batch_size=0",
        f"optim.grad_accum={args.grad_accum}", "optim.ppo_epochs=1", f"trainer.steps={args.steps}",
        f"trainer.seed={args.seed}", f"trainer.threads={args.threads}", "trainer.eval_prompts=0",
        "trainer.save_every=0",  # a checkpoint only at the end, after the last step's time/step
        "logging.progress=false", "logging.tensorboard=false", "logging.print_samples=0",
    ]  # fmt: skip
    if output_dir:
        out += [f"trainer.output_dir={output_dir}", f"trainer.run_name={run_name}"]
    return out


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


# ------------------------------------------------------------------------------------------- parent


def run_child(cmd: list[str], threads: int, log: Path) -> tuple[int, float, float]:
    """Run `cmd` with its output in `log`. Returns the exit code, wall and CPU seconds of the child (user +
    system of it and its waited-for descendants)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        returncode = subprocess.run(
            cmd, env=child_env(threads), stdout=f, stderr=subprocess.STDOUT, cwd=REPO
        ).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return returncode, wall, cpu


def log_path(arm: str) -> Path:
    """Where an arm's output goes (kept after the run, overwritten by the next run of that arm)."""
    return Path(tempfile.gettempdir()) / f"rl_step_{arm}.log"


def fail(arm: str) -> None:
    lines = [ln for ln in log_path(arm).read_text(errors="replace").splitlines() if ln.strip()]
    last = lines[-1] if lines else "(no output)"
    raise SystemExit(f"rl_step: the {arm} arm failed: {last} (full log: {log_path(arm)})")


def run_trl(args, overrides: list[str], indices: list[int], tmp: Path) -> dict[str, Any]:
    spec = {"overrides": overrides, "prompt_indices": indices, "steps": args.steps, "threads": args.threads,
            "output_dir": str(tmp / "trl")}  # fmt: skip
    (tmp / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "trl", "--spec", str(tmp / "spec.json"),
           "--child-out", str(tmp / "trl_rows.json")]  # fmt: skip
    rc, wall, cpu = run_child(cmd, args.threads, log_path("trl"))
    if rc != 0 or not (tmp / "trl_rows.json").is_file():
        fail("trl")
    out = json.loads((tmp / "trl_rows.json").read_text())
    for r in out["steps"]:
        print_step("trl", r)
    return {"process_wall_s": wall, "process_cpu_s": cpu, **out}


def run_sparserl(args, overrides: list[str], tmp: Path, arm: str = "sparserl") -> dict[str, Any]:
    metrics = tmp / "runs" / "rl_step" / "metrics.jsonl"
    cmd = [sys.executable, "-m", "sparserl.cli", "train", *overrides]
    rc, wall, cpu = run_child(cmd, args.threads, log_path(arm))
    if rc != 0 or not metrics.is_file():
        fail(arm)
    steps = []
    for m in (json.loads(line) for line in metrics.read_text().splitlines() if line.strip()):
        cpu_s = m["time/step_cpu"]
        tokens = round(m.get("length/mean", m.get("response_length/mean", 0.0)) * args.n)
        # time/reward existed until rewards overlapped the rollout: it has been inside time/rollout since
        row = step_row(m["step"], m["time/step"], cpu_s, m["time/rollout"], m.get("time/reward", 0.0) + m["time/score"],
                       m["time/train"], tokens)  # fmt: skip
        row.update(reward_mean=m.get("reward/mean"), time_reward_s=m.get("time/reward"), time_score_s=m["time/score"])  # fmt: skip
        steps.append(row)
        print_step(arm, row)
    return {"process_wall_s": wall, "process_cpu_s": cpu, "steps": steps}


def prompt_indices(args: argparse.Namespace) -> tuple[list[int], Any]:
    """The task rows sparserl's trainer draws at steps 1..N (its PromptSampler, 1 prompt per step; generated
    tasks keep every row), and the resolved sparserl config."""
    from sparserl.config import load_config
    from sparserl.seeds import PromptSampler
    from sparserl.tasks import make_task

    cfg = load_config(None, sparserl_overrides(args))
    sampler = PromptSampler(len(make_task(cfg.task, "train")), cfg.trainer.seed)
    return [sampler.take(1)[0] for _ in range(args.steps)], cfg


def summarise(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per arm: medians over every run's steps after the first `warmup` (all steps when a run is that short)."""
    out: dict[str, Any] = {}
    keys = ("wall_s", "cpu_s", "rollout_s", "scoring_s", "update_s", "completion_tokens", "completion_tokens_per_s")  # fmt: skip
    for arm in ARMS:
        steps = [s for r in runs if r["arm"] == arm for s in (r["steps"][warmup:] or r["steps"])]
        if steps:
            med = {
                k: statistics.median(v) if (v := [s[k] for s in steps if s[k] is not None]) else None
                for k in keys
            }
            out[arm] = {"steps_in_median": len(steps), **med}
    for arm, suffix in (
        ("sparserl", ""),
        ("sparserl-compiled", "_compiled"),
        ("sparserl-overlap", "_overlap"),
        ("sparserl-overlap-glibc", "_overlap_glibc"),
    ):
        if "trl" in out and arm in out:
            t, s = out["trl"], out[arm]
            out["ratio_wall" + suffix] = t["wall_s"] / s["wall_s"]
            out["ratio_cpu" + suffix] = t["cpu_s"] / s["cpu_s"] if t["cpu_s"] and s["cpu_s"] else None
            out["ratio_tokens_per_s" + suffix] = s["completion_tokens_per_s"] / t["completion_tokens_per_s"]
    return out


def goals(summary: dict[str, Any], dtype: str, command: str) -> dict[str, Any]:
    """The goal per sparserl arm measured: the default (eager) engine, and engine.compile=true when run."""
    out = {}
    for suffix, label in (("", ""), ("_compiled", ", engine.compile=true")):
        if "ratio_wall" + suffix not in summary:
            continue
        name = (f"One RL step >= 2x faster than TRL GRPOTrainer (fp32, same config and machine{label})"
                if dtype == "float32" else f"One RL step >= 2x faster than TRL GRPOTrainer at bf16 (reported{label})")  # fmt: skip
        v = summary["ratio_wall" + suffix]  # cpu_value: the same ratio in CPU seconds per step
        out[name] = {"value": v, "target": GOAL, "met": v >= GOAL, "cpu_value": summary["ratio_cpu" + suffix],
                     "command": command}  # fmt: skip
    for suffix, label in (("_overlap", ""), ("_overlap_glibc", " and trainer.malloc_mmap_threshold=0")):
        if "ratio_wall" + suffix not in summary:
            continue
        v = summary["ratio_wall" + suffix]
        for target, stretch in ((OVERLAP_GOAL, ""), (OVERLAP_STRETCH, " (stretch)")):
            out[f"One RL step >= {target:g}x faster than TRL GRPOTrainer with rollout.overlap{label}{stretch}"] = {
                "value": v, "target": target, "met": v >= target, "cpu_value": summary["ratio_cpu" + suffix],
                "command": command}  # fmt: skip
    return out


def other_goals() -> dict[str, Any]:
    """The step's other goals, measured by other benchmarks, copied here so that this file lists them all: the decode
    step's (decode_step.json), the bf16 step's (rl_step_bf16.json), and the GPU goal (rollout_gpu.json, from
    `benchmarks/rollout.py --device cuda`; not measured where no GPU run was made)."""
    out: dict[str, Any] = {GPU_GOAL: {"value": None, "target": GPU_GOAL_TARGET, "met": False, "command": "none: no GPU run",
                                      "reason": "not measured: no GPU run has been made"}}  # fmt: skip
    for name in ("decode_step.json", "rl_step_bf16.json", "rollout_gpu.json"):
        if (RESULTS / name).is_file():
            out.update(json.loads((RESULTS / name).read_text()).get("goals", {}))
    return out


@stoppable("benchmarks/rl_step.py", "results not written; run it again", exits=True)
def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        raise SystemExit(MISSING_TRL)
    if args.child == "trl":
        return trl_child(args)
    import trl

    torch.set_num_threads(args.threads)  # only so that machine_info reports the arms' thread count
    default = RESULTS / ("rl_step.json" if args.dtype == "float32" else "rl_step_bf16.json")
    quick = Path(tempfile.gettempdir()) / "rl_step_quick.json"
    out_path = Path(args.out or (quick if args.quick else default))
    indices, cfg = prompt_indices(args)
    settings = {
        "model": args.model, "steps": args.steps, "prompts_per_step": 1, "n": args.n,
        "max_new_tokens": args.max_new_tokens, "lr": args.lr, "kl_coef": args.kl_coef, "grad_accum": args.grad_accum,
        "threads": args.threads, "dtype": args.dtype, "seed": args.seed, "warmup_steps": args.warmup_steps,
        "prompt_indices": indices, "trl": trl.__version__,
    }  # fmt: skip
    kept = runs_with_settings(out_path, settings) if args.resume else []
    done = {(r["arm"], r["repeat"]) for r in kept}
    if args.resume:
        print(f"resuming: {len(kept)} runs kept from {out_path}" if kept else f"not resuming: {out_path} has no "
              "runs with these settings")  # fmt: skip
    mine: list[dict[str, Any]] = []
    trl_config = trl_config_kwargs(cfg, args.steps, "TMP/trl")

    def build(runs: list[dict[str, Any]]) -> dict[str, Any]:
        summary = summarise(runs, args.warmup_steps)
        return {
            "benchmark": "one RL step: sparserl train vs TRL GRPOTrainer (same model, prompts and settings)",
            "command": command_line(),
            "complete": {(a, i) for a in args.arms for i in range(args.repeats)} <= {(r["arm"], r["repeat"]) for r in runs},
            "settings": settings,
            "goals": {**goals(summary, args.dtype, command_line()), **(other_goals() if args.dtype == "float32" else {})},
            "summary": summary,
            "measured": MEASURED,
            "differences": DIFFERENCES + (BF16_DIFFERENCES if args.dtype == "bfloat16" else []),
            "sparserl_command": "python -m sparserl.cli train " + " ".join(sparserl_overrides(args, "TMP", "rl_step")),
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "eos": "stops a completion (both)"},
            "trl_config": trl_config,
            "machine": machine_info(),
            "runs": sorted(runs, key=lambda r: (r["repeat"], args.arms.index(r["arm"]) if r["arm"] in args.arms else 9)),
        }  # fmt: skip

    for repeat in range(args.repeats):
        for arm in args.arms:
            if (arm, repeat) in done:
                continue
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix=f"rl_step_{arm}_") as d:
                tmp = Path(d)
                if arm == "trl":
                    res = run_trl(args, sparserl_overrides(args), indices, tmp)
                else:
                    keys = ARM_KEYS.get(arm, [])
                    res = run_sparserl(
                        args, [*sparserl_overrides(args, str(tmp / "runs"), "rl_step"), *keys], tmp, arm
                    )
            mine.append({"arm": arm, "repeat": repeat, "load_avg_1min_before": load, **res})
            report = merge_runs_and_write(out_path, settings, mine, ("arm", "repeat"), args.resume, build)
    if not mine:
        report = merge_runs_and_write(out_path, settings, [], ("arm", "repeat"), args.resume, build)
    s = report["summary"]
    rows = [[arm, s[arm]["wall_s"], s[arm]["cpu_s"] or "-", s[arm]["rollout_s"], s[arm]["scoring_s"],
             s[arm]["update_s"], s[arm]["completion_tokens_per_s"], s[arm]["steps_in_median"]]
            for arm in ARMS if arm in s]  # fmt: skip
    which = f"steps {args.warmup_steps + 1}..{args.steps}" if args.steps > args.warmup_steps else "all steps"
    print(f"\n{args.model}, 1 prompt x {args.n}, {args.max_new_tokens} new tokens, {args.dtype}, {args.threads} "
          f"thread(s), kl {args.kl_coef:g}; medians of {which} over {args.repeats} repeat(s)")  # fmt: skip
    print_table(["arm", "step s", "cpu s", "rollout s", "scoring s", "update s", "tok/s", "steps"], rows)
    if "ratio_wall" in s:
        cpu = f"{s['ratio_cpu']:.2f}x" if s["ratio_cpu"] else "-"
        print(f"TRL / sparserl time per step: {s['ratio_wall']:.2f}x wall, {cpu} CPU (goal >= {GOAL:g}x)")
    print(f"wrote {out_path}")
    return report


if __name__ == "__main__":
    main()
