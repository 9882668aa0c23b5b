"""The reuse experiment rerun on SPEC-RL's coupled acceptance and batched verification: plain GRPO, SPEC-RL and
tree rollouts on prompts that return (experiments/reuse.yaml: SmolLM2-135M with LoRA, 32 sums of 1-2 digit
numbers, 6 epochs), 3 seeds each, at 64-token completions (the first experiment's length) and at 256, where
decoding dominates the rollout. GRPO is rerun too: the code under it changed since the first experiment.

    python experiments/reuse_v2.py rules   # the decision rules and goals (commit them before any run)
    python experiments/reuse_v2.py         # everything not done yet (resumable); ~16 CPU-hours at one thread
    python experiments/reuse_v2.py run grpo256-seed1 spec256-seed1 grpo256-seed2 spec256-seed2 \
        tree256-seed1 tree256-seed2     # the rest, in the order of the rule `order`
    python experiments/reuse_v2.py report  # goals from the committed parts

The rules are in docs/results/reuse_v2.json before any run. Every run uses the same code, sparserl as of
de3b275 (that of the first run), from a worktree of its own, so that work landing on main does not reach the
runs; each finished run's parts (docs/results/reuse_v2/parts/) are copied back to main and committed:

    git worktree add --detach ../reuse_v2_code de3b275
    cd ../reuse_v2_code && PYTHONPATH=$PWD python experiments/reuse_v2.py

and, from main, at each session's start and after each run, `python experiments/reuse_v2_machines.py
../reuse_v2_code`: it records the machine of every run (the rule `machines`) and copies the finished parts.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from arms import Experiment, main, run, write_comparison
from reuse import compare_pairs, later_epochs_time, with_eval_means
from reuse_v2_machines import load_machines, one_machine

from sparserl.signals import stoppable

LENGTHS = (64, 256)
TREE = ["rollout.n=2", "rollout.tree.enable=true", "rollout.tree.forks=1", "rollout.tree.children=1"]
ARMS: dict[str, list[str]] = {
    f"{arm}{n}": [f"rollout.max_new_tokens={n}", *overrides]
    for n in LENGTHS
    for arm, overrides in (("grpo", []), ("spec", ["rollout.spec.enable=true"]), ("tree", TREE))
}
SPEED_TARGETS = {64: 0.7, 256: 0.5}  # SPEC-RL's rollout seconds over epochs 2-6, over GRPO's: at most
MARGIN = 0.05  # non-inferiority margin of the held-out mean@8, fixed before the runs
RULES = {
    "setting": "experiments/reuse.yaml: 32 training prompts, 8 a step, 24 steps (6 epochs), seeds 0, 1, 2 shared "
    "by every arm; each arm changes only the keys in `arms` (rollout.max_new_tokens 64 or 256; SPEC-RL with "
    "its defaults: rollout.spec.acceptance=coupled, rollout.spec.verify=batched); runs one at a time at one "
    "thread, every 64-token run before any 256-token one, arms in the order grpo, spec, tree per seed",
    "held_out": "32 test-split prompts x 8 samples, temperature 1.0, top_p 1, seed 4321, dense, the run's "
    "max_new_tokens; each model in its own process",
    "spec_speed": "per length: value = mean over seeds of (sum of time/rollout over epochs 2-6 for SPEC-RL) / "
    "(the same for GRPO), paired by seed; met when <= 0.7 at 64 tokens and <= 0.5 at 256",
    "spec_quality": f"per length: non-inferiority of SPEC-RL's final held-out mean@8 to GRPO's with margin "
    f"{MARGIN}: the differences SPEC-RL - GRPO paired by seed, one-sided 95% t lower bound (df = 2); met when "
    f"the bound is above -{MARGIN}",
    "tree": "reported only, paired with GRPO by seed (the tree goal, rollout seconds per leaf against "
    "independent chains, is a benchmark's: benchmarks/tree_fork.py)",
    "machines": "added after the seed-0 64-token runs, before any other GRPO or SPEC-RL run finished (grpo64 "
    "seed 1 was training), because the machine changes between sessions: the third run's machine, an Intel Xeon, "
    "generated held-out tokens at about half the first two's rate (a one-thread test suite ran beside it): "
    "each run's machines are recorded in docs/results/reuse_v2/parts/machines.json "
    "(experiments/reuse_v2_machines.py); a seed's GRPO and SPEC-RL runs at one length form a speed pair only "
    "when both trained wholly on one machine; a pair that did not is trained again, both runs in one session "
    "(GRPO first), replacing it (curves and held-out); the speed goal is judged only when every seed's pair is "
    "one machine's",
    "budget": "~16 CPU-hours: 9 runs at 64 tokens x ~27 CPU-min (the first experiment's) + 9 at 256 x ~70 "
    "CPU-min (estimate: decoding 4x, the update ~2.5x) + 18 evaluations x 3-6 CPU-min; if it runs over, the "
    "tree arms at 256 are cut first",
    "order": "added when 12 of 18 runs were in (grpo256 seed 1 had trained 2 of 24 steps, no other 256-token "
    "run of seeds 1-2 had started): the remaining 256-token runs go grpo, spec for seed 1, then grpo, spec for "
    "seed 2, then the tree arms (report only) for seeds 1 and 2, so that the judged pairs land first and a "
    "budget cut falls on the tree arms, as the rule `budget` says; no judgment changes",
}


def speed_goal(n: int) -> str:
    return f"SPEC-RL: rollout seconds over epochs 2-6 <= {SPEED_TARGETS[n]}x GRPO's at {n}-token completions"


def quality_goal(n: int) -> str:
    return f"SPEC-RL: held-out mean@8 non-inferior to GRPO's (margin {MARGIN}) at {n}-token completions"


GOALS = {
    **{speed_goal(n): (f"spec{n}", SPEED_TARGETS[n]) for n in LENGTHS},
    **{quality_goal(n): (f"spec{n}", -MARGIN) for n in LENGTHS},
}


def paired_runs(runs: dict, arm: str, n: int) -> list[tuple[dict, dict]]:
    """(the arm's run, GRPO's) at length n for every seed where both finished."""
    pairs = [(runs.get(f"{arm}{n}-seed{s}"), runs.get(f"grpo{n}-seed{s}")) for s in EXPERIMENT.seeds]
    return [(a, g) for a, g in pairs if a and g]


def lower_bound(diffs: list[float]) -> float:
    """One-sided 95% t lower bound of the mean of paired differences (df = len - 1)."""
    from scipy import stats

    half = float(stats.t.ppf(0.95, len(diffs) - 1)) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return statistics.fmean(diffs) - half


def length_goals(runs: dict, n: int, machines: dict[str, list[str]]) -> dict:
    pairs = paired_runs(runs, "spec", n)
    base = {"command": EXPERIMENT.command, "seeds": len(pairs)}
    waiting = f"{len(pairs)} of {len(EXPERIMENT.seeds)} seeds' pairs in: judged once every seed's is"
    unmeasured = {"value": None, "met": None, "status": waiting, **base}
    speed = {"target": SPEED_TARGETS[n], **unmeasured}
    quality = {"target": -MARGIN, **unmeasured}
    mixed = [s for s in EXPERIMENT.seeds if not one_machine(machines, f"spec{n}-seed{s}", f"grpo{n}-seed{s}")]
    if len(pairs) == len(EXPERIMENT.seeds) and mixed:
        speed = {**speed, "status": f"seeds {mixed}: the pair did not train on one machine; train it again"}
    elif len(pairs) == len(EXPERIMENT.seeds):
        ratios = [later_epochs_time(a) / later_epochs_time(g) for a, g in pairs]
        value = statistics.fmean(ratios)
        speed = {"value": value, "target": SPEED_TARGETS[n], "met": value <= SPEED_TARGETS[n],
                 "per_seed": ratios, **base}  # fmt: skip
    held = [a["eval_mean"] - g["eval_mean"] for a, g in pairs if "eval_mean" in a and "eval_mean" in g]
    if len(held) == len(EXPERIMENT.seeds):
        bound = lower_bound(held)
        quality = {"value": bound, "target": -MARGIN, "met": bound > -MARGIN, "differences": held,
                   "unit": "one-sided 95% lower bound of SPEC-RL - GRPO", **base}  # fmt: skip
    return {speed_goal(n): speed, quality_goal(n): quality}


def comparison(runs: dict) -> dict:
    """Reported, not judged: per arm and length against GRPO, paired by seed, the held-out difference and the
    ratio of rollout seconds over epochs 2-6 (the arm's / GRPO's)."""
    out = {}
    for n in LENGTHS:
        for arm in ("spec", "tree"):
            out |= compare_pairs(paired_runs(runs, arm, n), f"{arm}{n}", f"grpo{n}", arm_over_base=True)
    return out


def judged_goals(runs: dict) -> dict:
    machines = load_machines()
    return {k: v for n in LENGTHS for k, v in length_goals(runs, n, machines).items()}


def judged(runs: dict) -> dict:
    """The goals; the comparison is written beside the runs (docs/results/reuse_v2/comparison.json)."""
    write_comparison(EXPERIMENT, comparison(runs))
    return judged_goals(runs)


EXPERIMENT = Experiment(
    name="reuse_v2",
    config=Path(__file__).resolve().parent / "reuse.yaml",
    arms=ARMS,
    rules=RULES,
    goal_targets=GOALS,
    curve_keys=(
        "reward/mean",
        "time/rollout",
        "time/step_cpu",
        "sampling/generated_tokens",
        "sampling/spec_rollout_s",
        "sampling/spec_verify_s",
    ),  # fmt: skip
    eval_prompts=32,
    eval_samples=8,
    plot_keys=("reward/mean", "time/rollout"),
)


def every_64_first(x: Experiment, only: list[str] | None, script: str | None) -> None:
    """`arms.run` in the rules' order: every 64-token run (seed by seed) before any 256-token one."""
    order = [
        f"{arm}-seed{seed}" for n in LENGTHS for seed in x.seeds for arm in x.arms if arm.endswith(str(n))
    ]
    run(x, only or order, script)


@stoppable("experiments/reuse_v2.py", "the part being written; finished parts are kept, re-run to go on")
def run_experiment() -> int:
    return main(EXPERIMENT, with_eval_means(judged), __file__, train=every_64_first)


if __name__ == "__main__":
    sys.exit(run_experiment())
