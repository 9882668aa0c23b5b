"""The reuse experiment: rollouts that reuse work against plain GRPO on prompts that return, SmolLM2-135M, 32
sums of 1-2 digit numbers for 6 epochs (experiments/reuse.yaml), 3 seeds each: plain GRPO (4 samples a prompt), SPEC-RL
(the same with rollout.spec), tree rollouts at the same 4 leaves a prompt (2 roots, one fork point each, one
child). Reward curves, rollout time per step, held-out accuracy (each model in its own process).

    python experiments/reuse.py            # everything not done yet (resumable); ~4.5 CPU-hours at one thread
    python experiments/reuse.py report     # goals from the committed parts

The decision rules are in docs/results/reuse.json (with the goals the benchmarks measured) before any run.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from arms import Experiment, main, paired, write_comparison

from sparserl.signals import stoppable

STEPS_PER_EPOCH = 4  # 32 prompts, 8 a step
ARMS: dict[str, list[str]] = {
    "grpo": [],
    "spec": ["rollout.spec.enable=true"],
    "tree": ["rollout.n=2", "rollout.tree.enable=true", "rollout.tree.forks=1", "rollout.tree.children=1"],
}
RULES = {
    "setting": "experiments/reuse.yaml: 32 training prompts, 8 a step, 24 steps (6 epochs), seeds 0, 1, 2 shared "
    "by every arm; each arm changes only the keys in `arms`; runs one at a time at one thread, arms in the order "
    "grpo, spec, tree per seed",
    "held_out": "32 test-split prompts x 8 samples, temperature 1.0, top_p 1, seed 4321, dense, 64 new tokens; "
    "each model in its own process",
    "spec_speed": "value = mean over seeds of (sum of time/rollout over epochs 2-6 for GRPO) / (the same for SPEC-RL), "
    "paired by seed; met when >= 1.5",
    "spec_quality": "met when |mean final held-out mean@8 of SPEC-RL - that of GRPO| <= the sample standard "
    "deviation of GRPO's over the 3 seeds (the issue's rule; it is not an equivalence test, and no claim of "
    "'no difference' is made from it)",
    "tree": "reported only (its goal, tokens per leaf, is measured by benchmarks/tree_tokens.py)",
    "budget": "under 5 CPU-hours: 9 runs x ~27 CPU-min (67 s a step measured on the first steps of a run) + 9 "
    "evaluations x ~3 CPU-min = ~4.5 CPU-hours (estimate); if it runs over, the tree arm is cut first",
}
SPEED = "SPEC-RL: rollout time over epochs 2-6 >= 1.5x lower than plain GRPO"
QUALITY = "SPEC-RL: final held-out reward within one standard deviation of plain GRPO over 3 seeds"
GOALS = {SPEED: ("spec", 1.5), QUALITY: ("spec", 1.0)}


def later_epochs_time(entry: dict) -> float:
    return sum(entry["curves"]["time/rollout"][STEPS_PER_EPOCH:])


def paired_runs(runs: dict, arm: str) -> list[tuple[dict, dict]]:
    """(the arm's run, GRPO's) for every seed where both finished."""
    pairs = [(runs.get(f"{arm}-seed{s}"), runs.get(f"grpo-seed{s}")) for s in EXPERIMENT.seeds]
    return [(a, g) for a, g in pairs if a and g]


def goals(runs: dict) -> dict:
    pairs = paired_runs(runs, "spec")
    base = {"command": EXPERIMENT.command, "seeds": len(pairs)}
    if not pairs:
        unmeasured = {"value": None, "met": False, "reason": "not run yet", **base}
        return {SPEED: {"target": 1.5, **unmeasured}, QUALITY: {"target": 1.0, **unmeasured}}
    ratios = [later_epochs_time(g) / later_epochs_time(a) for a, g in pairs]
    speed = {"value": statistics.fmean(ratios), "target": 1.5, "met": statistics.fmean(ratios) >= 1.5,
             "per_seed": ratios, **base}  # fmt: skip
    held = [(a["eval_mean"], g["eval_mean"]) for a, g in pairs if "eval_mean" in a and "eval_mean" in g]
    if len(held) < 2:
        return {
            SPEED: speed,
            QUALITY: {"target": 1.0, "value": None, "met": False, "reason": "not run yet", **base},
        }
    gap = abs(statistics.fmean(a for a, _ in held) - statistics.fmean(g for _, g in held))
    sd = statistics.stdev(g for _, g in held)
    quality = {"value": gap / sd if sd else float("inf"), "target": 1.0, "met": gap <= sd, "gap": gap,
               "grpo_sd": sd, "unit": "|mean difference| / GRPO's sd over seeds", **base}  # fmt: skip
    return {SPEED: speed, QUALITY: quality}


def compare_pairs(pairs: list[tuple[dict, dict]], arm: str, base: str, arm_over_base: bool = False) -> dict:
    """An arm against its base, paired by seed: the held-out mean@8 difference and the ratio of rollout seconds
    over epochs 2-6 (the base's / the arm's, or with `arm_over_base` the arm's / the base's)."""
    out = {}
    held = [a["eval_mean"] - g["eval_mean"] for a, g in pairs if "eval_mean" in a and "eval_mean" in g]
    if held:
        out[f"{arm} - {base}: held-out mean@8"] = paired(held)
    if pairs:
        seconds = [(later_epochs_time(a), later_epochs_time(g)) for a, g in pairs]
        label = f"{arm} / {base}" if arm_over_base else f"{base} / {arm}"
        ratios = [a / g if arm_over_base else g / a for a, g in seconds]
        out[f"{label}: rollout seconds over epochs 2-6"] = paired(ratios)
    return out


def comparison(runs: dict) -> dict:
    """Reported, not judged: per arm against GRPO (`compare_pairs`)."""
    return {
        k: v
        for arm in ("spec", "tree")
        for k, v in compare_pairs(paired_runs(runs, arm), arm, "grpo").items()
    }


def judged_and_compared(runs: dict) -> dict:
    """The goals; the comparison is written beside the runs (docs/results/reuse/comparison.json)."""
    write_comparison(EXPERIMENT, comparison(runs))
    return goals(runs)


def with_eval_means(goals_fn):
    """The held-out mean reward of each evaluated run (mean@8) added before judging."""

    def judge(runs: dict) -> dict:
        for entry in runs.values():
            if "pass@k" in entry:
                entry["eval_mean"] = entry["pass@k"][0]  # pass@1 of binary rewards = the mean reward
        return goals_fn(runs)

    return judge


EXPERIMENT = Experiment(
    name="reuse",
    config=Path(__file__).resolve().parent / "reuse.yaml",
    arms=ARMS,
    rules=RULES,
    goal_targets=GOALS,
    curve_keys=("reward/mean", "time/rollout", "time/step_cpu", "sampling/generated_tokens"),
    eval_prompts=32,
    eval_samples=8,
    plot_keys=("reward/mean", "time/rollout"),
)


@stoppable("experiments/reuse.py", "the part being written; finished parts are kept, re-run to go on")
def run_experiment() -> int:
    return main(EXPERIMENT, with_eval_means(judged_and_compared), __file__)


if __name__ == "__main__":
    sys.exit(run_experiment())
