"""The sampling experiment: GRPO, DARS, VCRL, DAPO's dynamic sampling and uniqueness-aware advantages at an equal
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

import statistics
import sys
from pathlib import Path

from arms import Experiment, main, paired, pass_curve, write_rules  # noqa: F401 - pass_curve, write_rules: tests

from sparserl.signals import stoppable

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
    "budget": "at most 6 CPU-hours: 15 runs x ~900 CPU-s + 15 evaluations x ~250 CPU-s = ~4.8 CPU-hours "
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


def goal_value(name: str, arm: str, target: float, runs: dict) -> dict:
    pairs = [(runs.get(run_name(arm, s)), runs.get(run_name("grpo", s))) for s in SEEDS]
    pairs = [(a, g) for a, g in pairs if a is not None and g is not None]
    base = {"target": target, "command": COMMAND, "seeds": len(pairs)}
    if arm == "uniqueness":  # paired by held-out evaluations, not by curves
        pairs = [(a, g) for a, g in pairs if "auc" in a and "auc" in g]
        base["seeds"] = len(pairs)
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


def goals(runs: dict) -> dict:
    """Every goal's value from the pairs present; judged (met or not) only once all seeds are in."""
    out = {name: goal_value(name, arm, target, runs) for name, (arm, target) in GOALS.items()}
    for goal in out.values():
        if goal["value"] is not None and goal["seeds"] < len(SEEDS):
            goal["met"] = False
            goal["reason"] = (
                f"interim: {goal['seeds']} of {len(SEEDS)} seeds paired so far; not judged until all are"
            )
    return out


EXPERIMENT = Experiment(
    name="sampling",
    config=Path(__file__).resolve().parent / "sampling.yaml",
    arms=ARMS,
    rules=RULES,
    goal_targets=GOALS,
    seeds=SEEDS,
    extra=[f"sampling.token_budget={TOKEN_BUDGET}"],
    curve_keys=(
        "reward/mean",
        "sampling/solved_prompt_frac",
        "sampling/zero_variance_frac",
        "sampling/generated_tokens",
        "sampling/reward_per_token",
        "time/step_cpu",
    ),  # fmt: skip
    eval_prompts=EVAL_PROMPTS,
    eval_samples=EVAL_SAMPLES,
    eval_seed=EVAL_SEED,
    plot_keys=("reward/mean", "sampling/solved_prompt_frac", "sampling/zero_variance_frac"),
    budget_key="sampling/generated_tokens",
)
RESULTS = EXPERIMENT.results


@stoppable("experiments/sampling.py", "the part being written; finished parts are kept, re-run to go on")
def run_experiment() -> int:
    return main(EXPERIMENT, goals, __file__)


if __name__ == "__main__":
    sys.exit(run_experiment())
