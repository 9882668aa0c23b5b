"""The SAPO experiment: two nodes (independent trainers, each its own policy and seed) on one local Ray
cluster, SmolLM2-135M arithmetic (experiments/sapo.yaml: 1-2 digit sums, 4 samples a prompt), each training on 4
local + 4 shared groups a step against 8 local + 0 shared, the same seeds. Reward curves and each node's held-out accuracy (each model in
its own process). Needs both cores: the two nodes of a pair run side by side, at one thread each.

    python experiments/sapo.py            # everything not done yet (resumable per node); ~3.6 CPU-hours
    python experiments/sapo.py report

No goal is judged here (the SAPO experiment's goals are the Ray benchmarks'); the comparison is reported paired by
seed, with the rules written in docs/results/sapo.json before any run.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from arms import ROOT, Experiment, curves_of, evaluate_run, main, paired, part_goals, write_comparison
from study import train_arm, write_with_goals

sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import update_result  # noqa: E402  (ray.json's sections are merged as its benchmarks merge them)

from sparserl.signals import stoppable

STEPS = 15
RAY_RESULTS = ROOT / "docs" / "results" / "ray.json"
MODES = {"shared": ["rollout.prompts_per_step=4", "distributed.swarm.shared_groups=4"],
         "local": ["rollout.prompts_per_step=8", "distributed.swarm.shared_groups=0"]}  # fmt: skip
ARMS = {
    f"{mode}_node{node}": [*o, f"distributed.swarm.node={node}"]
    for mode, o in MODES.items()
    for node in (0, 1)
}
RULES = {
    "setting": f"experiments/sapo.yaml (SmolLM2-135M, LoRA, 1-2 digit sums, 4 samples a prompt), {STEPS} steps; "
    "node 1 runs at trainer.seed + 100; per seed and mode the two nodes run side by side on one local Ray (one "
    "thread each) sharing a pool named after the mode and seed; 'shared': 4 local + 4 drawn groups a step (SAPO's "
    "best split), 'local': 8 local, nothing drawn (still published)",
    "held_out": "32 test-split prompts x 8 samples, temperature 1.0, seed 4321, dense; each model in its own process",
    "comparison": "per node, paired by seed (df = 2): held-out pass@1 and mean training reward, shared - local, "
    "with the paired 95% t interval; reported, not judged (no target in the issue)",
    "budget": f"under 4 CPU-hours: 12 runs x {STEPS} steps x ~65 CPU-s (a step of 8 prompts x 4 samples in "
    "experiments/reuse.py's runs; a shared node decodes half of them) + 12 evaluations x ~1.5 CPU-min = ~3.6 "
    "CPU-hours, ~1.8 hours of wall time on both cores. Revised before any run: the first design (experiments/"
    "sampling.yaml's 1-3 digit sums, 8 samples a prompt, 30 steps, 64 x 16 held-out samples) was estimated at 12 "
    "CPU-min a run, but a step of it takes ~115 CPU-s (measured in the sampling runs): ~12 CPU-hours",
}


def run_pairs(x: Experiment, only: list[str] | None = None, script: str | None = None) -> None:
    """Each (mode, seed): both nodes side by side on one Ray cluster; a finished node is not run again; each
    node evaluated once its pair has trained."""
    import ray

    if only:
        raise SystemExit("experiments/sapo.py run trains whole pairs: it takes no run names")

    for seed in x.seeds:
        for mode in MODES:
            names = [f"{mode}_node{n}" for n in (0, 1)]
            if all(x.part("curves", a, seed).is_file() for a in names):
                continue
            ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", namespace="sparserl")
            address = ray.get_runtime_context().gcs_address
            common = ["distributed.swarm.enable=true", f"distributed.ray_address={address}",
                      f"distributed.swarm.pool=sapo-{mode}-{seed}", f"trainer.steps={STEPS}"]  # fmt: skip
            jobs = [(a, [*x.arms[a], *common, f"trainer.seed={seed + 100 * n}"]) for n, a in enumerate(names)]
            with ThreadPoolExecutor(2) as pool:
                futures = [
                    pool.submit(train_arm, x.runs, f"{a}-seed{seed}", o, [], x.config) for a, o in jobs
                ]
                runs = [f.result() for f in futures]
            ray.shutdown()
            for (a, _), path in zip(jobs, runs, strict=True):
                curves = curves_of(x, path)
                write_with_goals(
                    x.part("curves", a, seed), {"run": str(path), "curves": curves}, part_goals(x)
                )
                if script is not None:
                    evaluate_run(x, script, a, seed)


def comparison(runs: dict) -> dict:
    out = {}
    for node in (0, 1):
        for key in ("pass@1", "reward/mean"):
            diffs = [runs[f"shared_node{node}-seed{s}"][key] - runs[f"local_node{node}-seed{s}"][key]
                     for s in EXPERIMENT.seeds
                     if key in runs.get(f"shared_node{node}-seed{s}", {})
                     and key in runs.get(f"local_node{node}-seed{s}", {})]  # fmt: skip
            if diffs:
                out[f"node{node} {key}: shared - local"] = paired(diffs)
    return out


def goals(runs: dict) -> dict:
    """None judged; the comparison is written beside the runs and, with each arm's means, into ray.json (the
    issue's results file, whose goals are the Ray benchmarks')."""
    comp = comparison(runs)
    write_comparison(EXPERIMENT, comp)
    section = {"results": "docs/results/sapo.json", "means": arm_means(runs), "comparison": comp}
    update_result(RAY_RESULTS, "sapo", section, {})
    return {}


def arm_means(runs: dict) -> dict:
    """Per arm, the mean over its evaluated seeds of held-out pass@1 and mean training reward."""
    out = {}
    for arm in ARMS:
        for key in ("pass@1", "reward/mean"):
            vals = [
                runs[f"{arm}-seed{s}"][key] for s in EXPERIMENT.seeds if key in runs.get(f"{arm}-seed{s}", {})
            ]
            if vals:
                out.setdefault(arm, {})[key] = sum(vals) / len(vals)
    return out


EXPERIMENT = Experiment(
    name="sapo",
    config=Path(__file__).resolve().parent / "sapo.yaml",
    arms=ARMS,
    rules=RULES,
    goal_targets={},
    curve_keys=("reward/mean", "sampling/swarm_external_groups", "time/step"),
    plot_keys=("reward/mean",),
    eval_prompts=32,
    eval_samples=8,
)


@stoppable("experiments/sapo.py", "the pair being trained; finished nodes are kept, re-run to go on")
def run_experiment() -> int:
    return main(EXPERIMENT, goals, __file__, train=run_pairs)  # the nodes of a pair run side by side


if __name__ == "__main__":
    sys.exit(run_experiment())
