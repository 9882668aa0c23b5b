"""P5 stability v2: does alpha's tail stay put during RL, with the power to say so? Sparrow calibrates once per
model because P5 hardly moves across RL iterations; v1 (experiments/p5_stability.py) read that from one prompt x 4
samples of another task, whose seed-to-seed range (0.04-0.07) was the whole margin.

1. Train one run on experiments/distill_sparse.yaml's task (SmolLM2-135M, LoRA, sums of 1-3 digit numbers, token
   TIS) with block_topk at a fixed budget of 64 positions read (pages of 16, layers 0-1 dense), 24 steps,
   checkpoints at 12 and 24.
2. Per checkpoint (the base model is step 0), in its own process: 8 test-split prompts of the same task x 8
   samples (the same prompts and sampling seed at every step), 64 new tokens, the exact alpha of every token at
   the same budget; the tokens are kept (safetensors) so that the report computes from raw data.
3. Per bin of 32 positions holding >= 32 sequences at both steps: delta = P5(step 24) - P5(step 0); its 90%
   interval from 2000 sequence-level bootstrap draws per step (independent samples: each step draws its own
   sequences); equivalent when the interval lies inside +-0.03 (the margin fixed here, before any run: two
   one-sided tests at 5%). Step 12 is reported the same way.

    python experiments/p5_stability_v2.py          # run or resume every part, then the report (~0.6 CPU-hours)
    python experiments/p5_stability_v2.py report   # the report from the parts present
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from study import ROOT, read_metrics, train_arm, write_with_goals

from sparserl.signals import stoppable

CONFIG = ROOT / "experiments" / "distill_sparse.yaml"
RUNS = ROOT / "runs" / "p5_stability_v2"
RUN = "block_topk-64"
TRAIN = ["kv.budget=64", "trainer.steps=24", "trainer.save_every=12", "trainer.keep_last=3", "trainer.seed=0"]
STEPS = (0, 12, 24)
PROMPTS, SAMPLES, NEW_TOKENS, SEED, BIN = 8, 8, 64, 777, 32
MARGIN, RESAMPLES, MIN_SEQUENCES = 0.03, 2000, 32
RESULTS = ROOT / "docs" / "results" / "p5_stability_v2.json"
PARTS = ROOT / "docs" / "results" / "p5_stability_v2"
COMMAND = "python experiments/p5_stability_v2.py"
GOAL = f"P5 stays put during RL: every measured bin's delta P5 (step 24 - step 0) has its 90% interval in +-{MARGIN}"
RULES = {
    "setting": f"{CONFIG.relative_to(ROOT)} + {' '.join(TRAIN)} (block_topk pages of 16, layers 0-1 dense)",
    "measurement": f"per step in {STEPS}: test prompts 0-{PROMPTS - 1} x {SAMPLES} samples, seed {SEED}, "
    f"{NEW_TOKENS} new tokens, temperature 1, exact alpha at budget 64; bins of {BIN} positions",
    "equivalence": f"per bin with >= {MIN_SEQUENCES} sequences at both steps: the 90% percentile interval of "
    f"{RESAMPLES} draws of P5(step) - P5(step 0), each step's P5 resampled over its own sequences; equivalent "
    f"when inside [-{MARGIN}, {MARGIN}], moved when wholly outside, else inconclusive",
    "goal": "met when every measured bin at step 24 is equivalent",
    "budget": "~0.6 CPU-hours: 24 steps x ~55 CPU-s + 3 measurements x ~5 CPU-min (estimate before the run)",
}


def part(step: int) -> Path:
    return PARTS / f"step-{step}.safetensors"


def measure(step: int) -> None:
    """Step 2 for one checkpoint (in its own process)."""
    from sparserl.config import load_config
    from sparserl.engine import KVConfig
    from sparserl.engine.acceptance import measure_acceptance
    from sparserl.eval.calibrate_store import write_acceptance
    from sparserl.eval.loading import load_eval_model
    from sparserl.models import encode_prompt
    from sparserl.tasks import make_task
    from sparserl.trainer import checkpoint_path

    spec = "smollm2-135m" if step == 0 else str(checkpoint_path(RUNS / RUN, step))
    loaded = load_eval_model(spec)
    task = make_task(load_config(CONFIG).task, "test")
    prompts = [encode_prompt(loaded.tokenizer, task[i].messages) for i in range(PROMPTS)]
    kv = KVConfig(method="block_topk", budget=64, page_size=16, dense_layers=[0, 1])
    alpha = measure_acceptance(loaded.model, loaded.tokenizer, prompts, kv, SAMPLES, NEW_TOKENS, seed=SEED)
    PARTS.mkdir(parents=True, exist_ok=True)
    write_acceptance(part(step), alpha)


def delta(base: dict, later: dict, bin_index: int) -> dict | None:
    """The bin's delta P5 and its interval, or None when either step has too few sequences there."""
    import torch

    from sparserl.algo.acceptance import bootstrap_quantile_draws, percentile_interval

    picked = []
    for tokens in (base, later):
        inside = torch.div(tokens["positions"], BIN, rounding_mode="floor") == bin_index
        picked.append((tokens["exact"][inside], tokens["sequences"][inside]))
    if min(int(torch.unique(s).numel()) for _, s in picked) < MIN_SEQUENCES:
        return None
    (a, sa), (b, sb) = picked
    draws = [bootstrap_quantile_draws(v, s, 0.05, RESAMPLES, seed=k) for k, (v, s) in enumerate(picked)]
    low, high = percentile_interval(draws[1] - draws[0])
    p5 = [torch.quantile(v.double(), 0.05).item() for v in (a, b)]
    verdict = (
        "equivalent" if low >= -MARGIN and high <= MARGIN
        else "moved" if high < -MARGIN or low > MARGIN
        else "inconclusive"
    )  # fmt: skip
    return {"bin": [bin_index * BIN, (bin_index + 1) * BIN], "p5_base": p5[0], "p5": p5[1],
            "delta": p5[1] - p5[0], "interval90": [low, high], "verdict": verdict}  # fmt: skip


def report() -> dict:
    from safetensors.torch import load_file

    tokens = {s: load_file(part(s)) for s in STEPS if part(s).is_file()}
    rewards = [r["reward/mean"] for r in read_metrics(RUNS / RUN) if "reward/mean" in r]
    out: dict = {"rules": RULES, "reward_curve": rewards, "steps": {}}
    for step in STEPS[1:]:
        if 0 in tokens and step in tokens:
            last = int(max(tokens[0]["positions"].max(), tokens[step]["positions"].max())) // BIN
            cells = [delta(tokens[0], tokens[step], i) for i in range(last + 1)]
            out["steps"][step] = [c for c in cells if c is not None]
    final = out["steps"].get(STEPS[-1])
    goal = {"value": None, "target": MARGIN, "met": False, "command": COMMAND, "reason": "not run yet"}
    if final:
        widest = max(max(abs(c["interval90"][0]), abs(c["interval90"][1])) for c in final)
        goal = {"value": widest, "target": MARGIN, "met": all(c["verdict"] == "equivalent" for c in final),
                "command": COMMAND, "verdicts": [c["verdict"] for c in final]}  # fmt: skip
    write_with_goals(RESULTS, out, {GOAL: goal})
    print(json.dumps(out["steps"], indent=1))
    return out


@stoppable("experiments/p5_stability_v2.py", "finished parts are kept; run the same command to go on")
def main() -> int:
    stage = sys.argv[1] if len(sys.argv) > 1 else "all"
    if stage == "measure-one":
        measure(int(sys.argv[2]))
        return 0
    if stage == "all":
        if not part(STEPS[-1]).is_file():
            train_arm(RUNS, RUN, TRAIN, [], CONFIG)
        for step in STEPS:
            if not part(step).is_file():
                cmd = [sys.executable, __file__, "measure-one", str(step)]
                print("$", " ".join(cmd), flush=True)
                if subprocess.run(cmd, cwd=ROOT).returncode:
                    raise SystemExit(f"measuring step {step} failed (its error is above)")
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
