"""Issue 37's experiment: GRPO, DARS, VCRL, DAPO's dynamic sampling and uniqueness-aware advantages at an equal
rollout budget (drawn tokens), SmolLM2-135M on sums of 1-3 digit numbers, 3 seeds each.

    python experiments/sampling.py            # everything not done yet: train, evaluate, report (resumable)
    python experiments/sampling.py run        # train the arms (each resumes from its last checkpoint)
    python experiments/sampling.py eval       # evaluate each trained model, each in a process of its own
    python experiments/sampling.py report     # goals and curves from the committed parts

Each finished run's curves and each model's held-out evaluation are committed as parts under
docs/results/sampling/parts/; the report reads only parts. The decision rules are written in
docs/results/sampling.json before any run (`rules`), and the report never changes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from study import read_metrics, train_arm, write_atomic, write_with_goals

from sparserl.eval.metrics import pass_at_k
from sparserl.signals import stoppable

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "sampling.yaml"
RESULTS = ROOT / "docs" / "results" / "sampling.json"
PARTS = ROOT / "docs" / "results" / "sampling" / "parts"
OUT = ROOT / "runs" / "sampling"
COMMAND = "python experiments/sampling.py"

SEEDS = (0, 1, 2)
TOKEN_BUDGET = 40_000  # ~15 GRPO steps of 8 prompts x 8 samples x ~40 tokens
EVAL_PROMPTS, EVAL_SAMPLES, EVAL_SEED = 64, 16, 4321
ARMS: dict[str, list[str]] = {
    "grpo": [],
    "dars": ["sampling.method=dars"],
    "vcrl": ["sampling.method=vcrl"],
    "dapo_dynamic": ["sampling.dynamic=true"],
    "uniqueness": ["shaping.method=uniqueness", "shaping.judge=rule"],
}

RULES = {
    "setting": f"experiments/sampling.yaml; every arm ends at sampling.token_budget={TOKEN_BUDGET} drawn tokens "
    "(trainer.steps=100 only bounds it); seeds 0, 1, 2 shared by every arm (same prompt order, sampling seed, "
    "LoRA init); each arm changes only the keys in `arms`",
    "held_out": f"{EVAL_PROMPTS} test-split prompts x {EVAL_SAMPLES} samples, temperature 1.0, top_p 1, "
    f"seed {EVAL_SEED}, dense, 64 new tokens; each model in its own process",
    "pass_at_k": "unbiased pass@k (Chen et al.) per prompt from its 16 samples, k = 1..16, averaged over prompts; "
    "AUC = mean of pass@k over k = 1..16 (the area under the curve over the k axis, normalised to [0, 1])",
    "dars": "goal value = mean over seeds of (mean over steps of sampling/solved_prompt_frac, DARS) / (the same, "
    "GRPO); met when >= 1.5",
    "vcrl_dapo": "goal value = mean over seeds of (mean over steps of sampling/zero_variance_frac, arm) / (the same, "
    "GRPO); met when <= 0.5 (GRPO trains on every group it draws, so its fraction is the uniform sampler's)",
    "uniqueness": "paired by seed (df = 2): met when the mean AUC difference (uniqueness - GRPO) >= 0 and the mean "
    "pass@1 difference >= -0.01; both differences are reported with their paired 95% t interval; no claim of "
    "'no difference' is made from these (that would need an equivalence test with a margin)",
    "budget": "at most 6 CPU-hours: 15 runs x ~900 CPU-s + 16 evaluations x ~250 CPU-s = ~4.9 CPU-hours "
    "(estimate before the runs); what is cut is said in the report",
}
GOALS = {
    "DARS: >= 1.5x the prompts with a correct sample of GRPO at the same budget": ("dars", 1.5),
    "VCRL: <= 0.5x the zero-variance group fraction of uniform sampling": ("vcrl", 0.5),
    "DAPO dynamic sampling: <= 0.5x the zero-variance group fraction of uniform sampling": (
        "dapo_dynamic",
        0.5,
    ),
    "Uniqueness: AUC of pass@k >= GRPO's, pass@1 no more than 1 point lower": ("uniqueness", 0.0),
}


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def write_rules() -> None:
    """The decision rules and unmeasured goals, written (and committed) before any run."""
    if RESULTS.is_file() and "rules" in json.loads(RESULTS.read_text()):
        return
    goals = {
        name: {"value": None, "target": target, "met": False, "command": COMMAND, "reason": "not run yet"}
        for name, (_, target) in GOALS.items()
    }
    write_with_goals(RESULTS, {"rules": RULES, "arms": ARMS, "seeds": list(SEEDS)}, goals)


def curve_part(arm: str, seed: int) -> Path:
    return PARTS / "curves" / f"{run_name(arm, seed)}.json"


def eval_part(arm: str, seed: int) -> Path:
    return PARTS / "eval" / f"{run_name(arm, seed)}.json"


def run(args) -> None:
    """Train every arm and seed not trained yet; each finished run's curves become a part."""
    for seed in SEEDS:
        for arm, overrides in ARMS.items():
            if curve_part(arm, seed).is_file():
                continue
            extra = [f"trainer.seed={seed}", f"sampling.token_budget={TOKEN_BUDGET}"]
            path = train_arm(OUT, run_name(arm, seed), overrides + extra, [], CONFIG)
            keys = ("reward/mean", "sampling/solved_prompt_frac", "sampling/zero_variance_frac",
                    "sampling/generated_tokens", "sampling/reward_per_token", "time/step_cpu")  # fmt: skip
            rows = [r for r in read_metrics(path) if "reward/mean" in r]
            curves = {k: [r.get(k) for r in rows] for k in keys}
            write_atomic(
                curve_part(arm, seed), json.dumps({"run": str(path), "curves": curves}, indent=1) + "\n"
            )


def eval_one(arm: str, seed: int) -> None:
    """One model's held-out evaluation (called in a process of its own); per-prompt correct counts kept."""
    from sparserl.config import load_config
    from sparserl.eval.evaluate import evaluate
    from sparserl.eval.loading import load_eval_model
    from sparserl.tasks import make_task

    cfg = load_config(CONFIG)
    loaded = load_eval_model(str(OUT / run_name(arm, seed)))
    result = evaluate(
        loaded.model, loaded.tokenizer, make_task(cfg.task, "test"), samples=EVAL_SAMPLES, limit=EVAL_PROMPTS,
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, top_p=1.0, seed=EVAL_SEED,
    )  # fmt: skip
    correct = [sum(r >= 1.0 - 1e-9 for r in ex["dense"]["rewards"]) for ex in result["examples"]]
    part = {"correct": correct, "samples": EVAL_SAMPLES, "dense": result["dense"]}
    write_atomic(eval_part(arm, seed), json.dumps(part, indent=1) + "\n")


def evaluate_all(args) -> None:
    for seed in SEEDS:
        for arm in ARMS:
            if eval_part(arm, seed).is_file() or not curve_part(arm, seed).is_file():
                continue
            cmd = [sys.executable, __file__, "eval-one", arm, str(seed)]
            print("$", " ".join(cmd), flush=True)
            if subprocess.run(cmd, cwd=ROOT).returncode:
                raise SystemExit(f"evaluation of {run_name(arm, seed)} failed (its error is above)")


def pass_curve(part: dict) -> list[float]:
    n = part["samples"]
    return [statistics.fmean(pass_at_k(n, c, k) for c in part["correct"]) for k in range(1, n + 1)]


def paired(diffs: list[float]) -> dict:
    """Mean of paired differences with its 95% t interval (df = len - 1)."""
    from scipy import stats

    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"mean": mean, "n": len(diffs)}
    half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": len(diffs), "df": len(diffs) - 1}


def report(args) -> None:
    """Goals from the parts present; a goal whose parts are missing stays unmeasured (not met)."""
    goals, out = {}, {"rules": RULES, "arms": ARMS, "seeds": list(SEEDS), "per_run": {}}
    curves = {
        (a, s): json.loads(curve_part(a, s).read_text())
        for a in ARMS
        for s in SEEDS
        if curve_part(a, s).is_file()
    }
    evals = {
        (a, s): json.loads(eval_part(a, s).read_text())
        for a in ARMS
        for s in SEEDS
        if eval_part(a, s).is_file()
    }
    for (arm, seed), c in curves.items():
        entry = {k: statistics.fmean(v) for k, v in c["curves"].items() if v and None not in v}
        entry["steps"] = len(c["curves"]["reward/mean"])
        if (arm, seed) in evals:
            curve = pass_curve(evals[arm, seed])
            entry |= {"pass@k": curve, "auc": statistics.fmean(curve), "pass@1": curve[0]}
        out["per_run"][run_name(arm, seed)] = entry
    for name, (arm, target) in GOALS.items():
        goals[name] = goal_value(name, arm, target, out["per_run"])
    write_with_goals(RESULTS, out, goals)
    print(json.dumps(goals, indent=1))


def goal_value(name: str, arm: str, target: float, runs: dict) -> dict:
    pairs = [(runs.get(run_name(arm, s)), runs.get(run_name("grpo", s))) for s in SEEDS]
    pairs = [(a, g) for a, g in pairs if a is not None and g is not None]
    base = {"target": target, "command": COMMAND, "seeds": len(pairs)}
    if arm == "uniqueness":
        pairs = [(a, g) for a, g in pairs if "auc" in a and "auc" in g]
        if not pairs:
            return {**base, "value": None, "met": False, "reason": "not run yet"}
        auc = paired([a["auc"] - g["auc"] for a, g in pairs])
        p1 = paired([a["pass@1"] - g["pass@1"] for a, g in pairs])
        met = auc["mean"] >= 0 and p1["mean"] >= -0.01
        return {**base, "value": auc["mean"], "met": met, "auc_diff": auc, "pass@1_diff": p1}
    key = "sampling/solved_prompt_frac" if arm == "dars" else "sampling/zero_variance_frac"
    ratios = [a[key] / g[key] for a, g in pairs if g.get(key)]
    if not ratios:
        return {**base, "value": None, "met": False, "reason": "not run yet"}
    value = statistics.fmean(ratios)
    met = value >= target if arm == "dars" else value <= target
    return {**base, "value": value, "met": met, "per_seed": ratios}


@stoppable("experiments/sampling.py", "the part being written; finished parts are kept, re-run to go on")
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "stage", nargs="?", default="all", choices=["all", "rules", "run", "eval", "report", "eval-one"]
    )
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    write_rules()
    if args.stage == "eval-one":
        eval_one(args.rest[0], int(args.rest[1]))
        return 0
    for stage, fn in (("run", run), ("eval", evaluate_all), ("report", report)):
        if args.stage in ("all", stage):
            fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
