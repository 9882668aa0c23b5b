"""SPEC-RL's acceptance on SmolLM2-135M: how much of the previous responses the verifier accepts after one
optimizer step at several learning rates, against the KL between the two policies on those responses.

    python benchmarks/spec_reuse.py            # -> docs/results/reuse.json (~0.2 CPU-hours at one thread)
    python benchmarks/spec_reuse.py --cost     # section spec_cost_coupled: step 2's rollout time, SPEC-RL or not
                                               # (~10 CPU-min; --acceptance ratio: section spec_cost)

Each arm trains one step (8 prompts x 4 samples, the default config's task and length, dense rollouts, LoRA)
at learning rate lr, then runs step 2 on the same 8 prompts with `rollout.spec.enable=true`: every sample has
a draft. Reported per arm: the accepted fraction of draft tokens, the share of drafts delivered whole, and the
sampled-token KL estimate mean_t (log p_then - log p_now) over the drafts. lr = 0 must accept exactly every
token (the weights, and the batch-invariant verifier's numbers, are unchanged).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import update_result

from sparserl.signals import stoppable

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "reuse.json"  # the reuse experiment's results, section "spec_acceptance"
COMMAND = "python benchmarks/spec_reuse.py"
LRS = (0.0, 1e-5, 1e-4, 1e-3)
PROMPTS = 8


class FirstRows:
    """The first `count` prompts of a task (every step then draws all of them: each returns at step 2)."""

    def __init__(self, task, count: int) -> None:
        self.task, self.count = task, count
        self.name = getattr(task, "name", "task")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        return self.task[i]

    def __getattr__(self, name: str):
        if name == "task":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)


def arm(lr: float, seed: int, out: Path) -> dict:
    """One step at `lr`, then step 2 with every prompt's step-1 responses as drafts."""
    from sparserl.config import load_config
    from sparserl.tasks import make_task
    from sparserl.trainer import Trainer

    overrides = [
        "algo.preset=dense", f"optim.lr={lr}", "optim.weight_decay=0", f"trainer.seed={seed}",
        f"rollout.prompts_per_step={PROMPTS}", "rollout.n=4", "rollout.spec.enable=true", "trainer.steps=2",
        "trainer.eval_prompts=0", "trainer.threads=1", "trainer.save_every=0", "logging.progress=false",
        "logging.tensorboard=false", f"trainer.output_dir={out}", f"trainer.run_name=lr{lr}-seed{seed}",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    task = FirstRows(make_task(cfg.task), PROMPTS)
    with Trainer(cfg, task=task, eval_task=task) as trainer:
        batch, _ = trainer.rollout(1)
        trainer.learn(1, batch)
        trainer.state.step = 1
        cache = trainer.source.inner.cache
        prompts = [trainer.train_view.prompt_ids(r) for r, ds in cache.items() for _ in ds]
        drafts = [d for ds in cache.values() for d in ds]
        now = trainer.rollouts.backend.score(prompts, [d["tokens"] for d in drafts], cfg.rollout.temperature)
        diffs = [
            a - b for d, lp in zip(drafts, now, strict=True) for a, b in zip(d["logps"], lp, strict=True)
        ]
        t0 = time.process_time()
        _, metrics = trainer.rollout(2)
        return {
            "lr": lr,
            "seed": seed,
            "accepted_frac": metrics["sampling/spec_accepted_frac"],
            "whole_frac": metrics["sampling/spec_whole_frac"],
            "kl_sampled": statistics.fmean(diffs),
            "generated_tokens_step2": metrics["sampling/generated_tokens"],
            "step2_cpu_s": time.process_time() - t0,
        }


COST_KEYS = ("time/rollout", "sampling/spec_verify_s", "sampling/source_score_s", "sampling/generated_tokens",
             "sampling/spec_accepted_frac", "sampling/spec_rollout_s", "rollout/prefill_s", "rollout/decode_s",
             "rollout/decode_steps", "rollout/admissions")  # fmt: skip
# --cost's section per acceptance rule: 'spec_cost' was measured with SPEC-RL's ratio rule, one draft at a time
COST_SECTIONS = {"ratio": "spec_cost", "coupled": "spec_cost_coupled"}


def cost_arm(spec: bool, seed: int, out: Path, acceptance: str) -> dict:
    """Where a step's rollout time goes, with and without SPEC-RL: the experiment's config (experiments/reuse.yaml)
    on its first 8 prompts, one step, one update, then step 2 on the same prompts (with SPEC-RL, every sample
    has its step-1 response as a draft: the best case, one update between visits)."""
    from sparserl.config import load_config
    from sparserl.tasks import make_task
    from sparserl.trainer import Trainer

    overrides = [
        f"rollout.spec.enable={str(spec).lower()}", f"rollout.spec.acceptance={acceptance}",
        f"trainer.seed={seed}", "trainer.steps=2",
        "trainer.save_every=0", f"trainer.output_dir={out}", f"trainer.run_name=cost-spec{int(spec)}-seed{seed}",
    ]  # fmt: skip
    cfg = load_config(ROOT / "experiments" / "reuse.yaml", overrides)
    task = FirstRows(make_task(cfg.task), PROMPTS)
    steps = []
    with Trainer(cfg, task=task, eval_task=task) as trainer:
        for step in (1, 2):
            t0 = time.process_time()
            batch, metrics = trainer.rollout(step)
            cpu = time.process_time() - t0
            steps.append({"step": step, "rollout_and_score_cpu_s": cpu,
                          **{k: metrics[k] for k in COST_KEYS if k in metrics}})  # fmt: skip
            if step == 1:
                trainer.learn(1, batch)
                trainer.state.step = 1
    return {"spec": spec, "seed": seed, "steps": steps}


def cost(seeds: int, out: Path, acceptance: str) -> dict:
    """`cost_arm` with and without SPEC-RL per seed, the arms alternating in order from seed to seed."""
    arms = []
    for seed in range(seeds):
        for spec in (seed % 2 == 0, seed % 2 == 1):
            arms.append(cost_arm(spec, seed, out, acceptance))
    step2 = {spec: [a["steps"][1] for a in arms if a["spec"] == spec] for spec in (False, True)}
    medians = {
        ("spec" if spec else "plain"): {
            k: statistics.median(r[k] for r in rows) for k in set.intersection(*map(set, rows)) - {"step"}
        }
        for spec, rows in step2.items()
    }
    result = {"arms": arms, "step2_medians": medians, "config": "experiments/reuse.yaml", "prompts": PROMPTS,
              "acceptance": acceptance, "command": f"{COMMAND} --cost --acceptance {acceptance}"}  # fmt: skip
    update_result(OUT, COST_SECTIONS[acceptance], result, {})
    print(json.dumps(medians, indent=1))
    return result


def spearman(xs: list[float], ys: list[float]) -> float:
    from scipy import stats

    return float(stats.spearmanr(xs, ys).statistic)


@stoppable("benchmarks/spec_reuse.py", "the arm being run; re-run to redo it", exits=True)
def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "spec_reuse")
    parser.add_argument(
        "--cost", action="store_true", help="where step 2's rollout time goes, SPEC-RL or not"
    )
    parser.add_argument(
        "--acceptance",
        choices=sorted(COST_SECTIONS),
        default="coupled",
        help="--cost: rollout.spec.acceptance (each rule its own section)",
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.cost:
        return cost(args.seeds, args.out, args.acceptance)
    arms = [arm(lr, seed, args.out) for seed in range(args.seeds) for lr in LRS]
    identity = [a["accepted_frac"] for a in arms if a["lr"] == 0.0]
    changed = [a for a in arms if a["lr"] > 0]
    rho = spearman([a["kl_sampled"] for a in changed], [a["accepted_frac"] for a in changed])
    goals = {
        "SPEC-RL: unchanged weights and lenience 0 accept every draft token (SmolLM2-135M)": {
            "value": min(identity), "target": 1.0, "met": min(identity) == 1.0, "command": COMMAND,
        },
        "SPEC-RL: acceptance falls as the policies move apart (Spearman rho of accepted fraction vs KL < 0)": {
            "value": rho, "target": 0.0, "met": rho < 0, "command": COMMAND,
        },
    }  # fmt: skip
    result = {"arms": arms, "prompts": PROMPTS, "samples_per_prompt": 4, "lrs": list(LRS)}
    update_result(OUT, "spec_acceptance", result, goals)
    print(json.dumps({"goals": goals, **result}, indent=1))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
