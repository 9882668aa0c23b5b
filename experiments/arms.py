"""The driver shared by the arms-by-seeds experiments (experiments/sampling.py, reuse.py, ...): train every arm
and seed from one config (resumable), keep each finished run's curves and each model's held-out evaluation
(in a process of its own) as committed parts, and write the results file with its rules and goals.

An experiment module defines an `Experiment` and its `goals(per_run)` function and calls `main(experiment,
goals)`; `python experiments/<name>.py [rules|run|eval|report]` runs the stages (all by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

from study import read_metrics, train_arm, write_with_goals

from sparserl.eval.metrics import pass_at_k

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Experiment:
    """What an experiment runs: `arms` (name -> overrides of `config`) x `seeds`, every run also given
    `extra`; curves of `curve_keys` kept per step; held-out: `eval_prompts` test prompts x `eval_samples`."""

    name: str
    config: Path
    arms: dict[str, list[str]]
    rules: dict[str, str]
    goal_targets: dict[str, tuple[str, float]]  # goal name -> (arm it judges, target)
    seeds: tuple[int, ...] = (0, 1, 2)
    extra: list[str] = field(default_factory=list)
    curve_keys: tuple[str, ...] = ("reward/mean", "time/rollout", "time/step_cpu")
    eval_prompts: int = 64
    eval_samples: int = 16
    eval_seed: int = 4321
    results_root: Path = ROOT / "docs" / "results"
    plot_keys: tuple[str, ...] = ()  # curves drawn per run in the results' figure, beside held-out pass@k
    budget_key: str | None = None  # per-step spend whose running total is the figure's x axis (default: step)

    @property
    def results(self) -> Path:
        return self.results_root / f"{self.name}.json"

    @property
    def parts(self) -> Path:
        return self.results_root / self.name / "parts"

    @property
    def runs(self) -> Path:
        return ROOT / "runs" / self.name

    @property
    def command(self) -> str:
        return f"python experiments/{self.name}.py"

    def part(self, kind: str, arm: str, seed: int) -> Path:
        return self.parts / kind / f"{arm}-seed{seed}.json"


def write_rules(x: Experiment) -> None:
    """The decision rules and unmeasured goals, written (and committed) before any run; goals already in the
    file (measured by a benchmark) are kept."""
    old = json.loads(x.results.read_text()) if x.results.is_file() else {}
    if "rules" in old:
        return
    goals = {
        name: {"value": None, "target": target, "met": False, "command": x.command, "reason": "not run yet"}
        for name, (_, target) in x.goal_targets.items()
    }
    body = {k: v for k, v in old.items() if k != "goals"}
    write_with_goals(x.results, {**body, "rules": x.rules, "arms": x.arms, "seeds": list(x.seeds)},
                     {**goals, **old.get("goals", {})})  # fmt: skip


def write_comparison(x: Experiment, comparison: dict) -> None:
    """A comparison the experiment reports without judging, beside its parts (docs/results/<name>/
    comparison.json, printed too); its `goals` mapping is empty: the experiment's goals are in <name>.json."""
    out = {"judged_in": str(x.results.relative_to(ROOT)), "comparison": comparison}
    write_with_goals(x.results_root / x.name / "comparison.json", out, {})
    print(json.dumps(comparison, indent=1))


def run_names(x: Experiment, only: list[str] | None = None) -> list[tuple[str, int]]:
    """The (arm, seed) runs to train, in order: every one (seed by seed), or those `only` names
    ("arm-seedN"), in the order given."""
    every = {f"{arm}-seed{seed}": (arm, seed) for seed in x.seeds for arm in x.arms}
    unknown = [name for name in only or [] if name not in every]
    if unknown:
        raise SystemExit(f"{x.command} run: unknown run(s) {', '.join(unknown)}; known: {', '.join(every)}")
    return [every[name] for name in only] if only else list(every.values())


def run(x: Experiment, only: list[str] | None = None, script: str | None = None) -> None:
    """Train every arm and seed not trained yet (or those `only` names); each finished run's curves become a
    part. With `script`, each model is evaluated right after it trains, so a run directory lost later (a new
    machine) costs no evaluation."""
    for arm, seed in run_names(x, only):
        if not x.part("curves", arm, seed).is_file():
            path, curves = train_curves(x, arm, seed)
            write_with_goals(x.part("curves", arm, seed), {"run": str(path), "curves": curves}, part_goals(x))
        if script is not None:
            evaluate_run(x, script, arm, seed)


def train_curves(x: Experiment, arm: str, seed: int) -> tuple[Path, dict[str, list]]:
    """Train (or resume, or find finished) one run; its directory and its curves."""
    path = train_arm(
        x.runs, f"{arm}-seed{seed}", [*x.arms[arm], *x.extra, f"trainer.seed={seed}"], [], x.config
    )
    return path, curves_of(x, path)


def curves_of(x: Experiment, run: Path) -> dict[str, list]:
    """A finished run's `curve_keys`, one value per training step (None where a step did not log it)."""
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    return {k: [r.get(k) for r in rows] for k in x.curve_keys}


def retrain(x: Experiment, names: list[str], script: str) -> None:
    """Train again runs whose curves part is kept but whose model is gone (a new machine), to evaluate them:
    the new run must give the kept curves (timings aside), else it is another model and nothing is written."""
    for arm, seed in run_names(x, names):
        kept = x.part("curves", arm, seed)
        if not kept.is_file() or x.part("eval", arm, seed).is_file():
            print(
                f"{arm}-seed{seed}: {'already evaluated' if kept.is_file() else 'not trained yet'}; skipped"
            )
            continue
        _, curves = train_curves(x, arm, seed)
        old = json.loads(kept.read_text())["curves"]
        moved = [k for k in x.curve_keys if not k.startswith("time/") and curves.get(k) != old.get(k)]
        if moved:
            raise SystemExit(
                f"{arm}-seed{seed} trained again does not reproduce its kept curves ({', '.join(moved)} differ): "
                f"another code or machine gave another model; its run is in {x.runs}, nothing was evaluated"
            )
        evaluate_run(x, script, arm, seed)


def part_goals(x: Experiment) -> dict:
    """The goals mapping a part carries: the experiment's goals, judged only in its results file from all the
    parts together (a part alone judges none)."""
    where = str(x.results.relative_to(ROOT)) if x.results.is_relative_to(ROOT) else str(x.results)
    return {
        name: {"value": None, "target": target, "met": False, "command": x.command,
               "reason": f"a part: the goal is judged in {where} from every part"}
        for name, (_, target) in x.goal_targets.items()
    }  # fmt: skip


def eval_one(x: Experiment, arm: str, seed: int) -> None:
    """One model's held-out evaluation (in a process of its own); per-prompt correct counts kept."""
    from sparserl.config import load_config
    from sparserl.eval.evaluate import evaluate
    from sparserl.eval.loading import load_eval_model
    from sparserl.tasks import make_task

    cfg = load_config(x.config)
    loaded = load_eval_model(str(x.runs / f"{arm}-seed{seed}"))
    result = evaluate(
        loaded.model, loaded.tokenizer, make_task(cfg.task, "test"), samples=x.eval_samples,
        limit=x.eval_prompts, max_new_tokens=cfg.rollout.max_new_tokens, temperature=1.0, top_p=1.0,
        seed=x.eval_seed, details=True,
    )  # fmt: skip
    correct = [sum(r >= 1.0 - 1e-9 for r in ex["dense"]["rewards"]) for ex in result["examples"]]
    part = {"correct": correct, "samples": x.eval_samples, "dense": result["dense"]}
    write_with_goals(x.part("eval", arm, seed), part, part_goals(x))


def evaluate_run(x: Experiment, script: str, arm: str, seed: int) -> None:
    """Evaluate one trained model in a process of its own, unless its part exists; a model whose run directory
    is gone is reported and skipped (its curves part stays; its held-out numbers stay missing)."""
    if x.part("eval", arm, seed).is_file() or not x.part("curves", arm, seed).is_file():
        return
    if not (x.runs / f"{arm}-seed{seed}").is_dir():
        print(f"{arm}-seed{seed}: trained, but its run directory {x.runs / f'{arm}-seed{seed}'} is gone; "
              f"not evaluated (to evaluate it: {x.command} retrain {arm}-seed{seed})", flush=True)  # fmt: skip
        return
    cmd = [sys.executable, script, "eval-one", arm, str(seed)]
    print("$", " ".join(cmd), flush=True)
    if subprocess.run(cmd, cwd=ROOT).returncode:
        raise SystemExit(f"evaluation of {arm}-seed{seed} failed (its error is above)")


def evaluate_all(x: Experiment, script: str) -> None:
    for arm, seed in run_names(x):
        evaluate_run(x, script, arm, seed)


def pass_curve(part: dict) -> list[float]:
    """pass@k for k = 1..n, averaged over prompts (the unbiased estimator from each prompt's n samples)."""
    n = part["samples"]
    return [statistics.fmean(pass_at_k(n, c, k) for c in part["correct"]) for k in range(1, n + 1)]


def paired(diffs: list[float]) -> dict:
    """Mean of paired differences with its 95% t interval (df = len - 1)."""
    from scipy import stats

    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"mean": mean, "n": len(diffs)}
    # float(): scipy's numpy scalar would make every comparison a numpy bool, which JSON cannot hold
    half = float(stats.t.ppf(0.975, len(diffs) - 1)) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": len(diffs), "df": len(diffs) - 1}


def per_run(x: Experiment) -> dict[str, dict]:
    """Every finished run's curves (means) and, where evaluated, its pass@k curve, AUC and pass@1."""
    out = {}
    for arm in x.arms:
        for seed in x.seeds:
            if not x.part("curves", arm, seed).is_file():
                continue
            c = json.loads(x.part("curves", arm, seed).read_text())["curves"]
            entry: dict[str, Any] = {k: statistics.fmean(v) for k, v in c.items() if v and None not in v}
            entry["steps"], entry["curves"] = len(c["reward/mean"]), c
            if x.part("eval", arm, seed).is_file():
                ev = json.loads(x.part("eval", arm, seed).read_text())
                curve = pass_curve(ev)
                entry |= {"pass@k": curve, "auc": statistics.fmean(curve), "pass@1": curve[0]}
            out[f"{arm}-seed{seed}"] = entry
    return out


def report(x: Experiment, goals: Callable[[dict], dict]) -> None:
    """Goals from the parts present (a goal whose parts are missing stays unmeasured, not met); goals the
    experiment does not judge (a benchmark's) are kept."""
    runs = per_run(x)
    old = json.loads(x.results.read_text()) if x.results.is_file() else {}
    if old.get("rules", x.rules) != x.rules:
        raise SystemExit(
            f"the decision rules in {x.results} differ from {x.command}'s: rules are fixed before the runs they "
            "judge; restore the committed ones"
        )
    body = {k: v for k, v in old.items() if k != "goals"}
    judged = goals(runs)
    write_with_goals(x.results, {**body, "rules": x.rules, "arms": x.arms, "seeds": list(x.seeds),
                                 "per_run": runs}, {**old.get("goals", {}), **judged})  # fmt: skip
    if runs:
        draw(x, runs, x.results.with_suffix(".png"))
    print(json.dumps(judged, indent=1))


def draw(x: Experiment, runs: dict[str, dict], path: Path) -> None:
    """The results' figure: held-out pass@k per arm (mean over its evaluated seeds), then each of `plot_keys`
    per step of every run (an arm's seeds in one colour), against the running total of `budget_key` if set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, 1 + len(x.plot_keys), figsize=(4.2 * (1 + len(x.plot_keys)), 3.6), squeeze=False
    )
    colours = dict(zip(x.arms, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4, strict=False))
    for arm in x.arms:
        curves = [
            runs[f"{arm}-seed{s}"]["pass@k"] for s in x.seeds if "pass@k" in runs.get(f"{arm}-seed{s}", {})
        ]
        if curves:
            mean = [statistics.fmean(at_k) for at_k in zip(*curves, strict=True)]
            axes[0][0].plot(
                range(1, len(mean) + 1), mean, color=colours[arm], label=f"{arm} ({len(curves)} seeds)"
            )
    axes[0][0].set(xlabel="k", ylabel="held-out pass@k", title="held-out pass@k")
    for ax, key in zip(axes[0][1:], x.plot_keys, strict=True):
        for arm in x.arms:
            for n, seed in enumerate(s for s in x.seeds if f"{arm}-seed{s}" in runs):
                curves = runs[f"{arm}-seed{seed}"]["curves"]
                spent = curves.get(x.budget_key) if x.budget_key else None
                at = list(accumulate(v or 0 for v in spent)) if spent else None
                points = [
                    (at[i] if at else i + 1, v) for i, v in enumerate(curves.get(key, [])) if v is not None
                ]
                if points:
                    ax.plot(
                        *zip(*points, strict=True),
                        color=colours[arm],
                        alpha=0.8,
                        label=arm if n == 0 else None,
                    )
        ax.set(xlabel=f"{x.budget_key} (running total)" if x.budget_key else "step", title=key)
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(x: Experiment, goals: Callable[[dict], dict], script: str, train: Callable[..., None] = run) -> int:
    """The stages: rules (always first), `train` (the runs, each evaluated once trained; `run` by default;
    `run NAME...` trains those runs in that order), eval, report; `retrain NAME...` on its own."""
    parser = argparse.ArgumentParser(
        description=f"{x.name}: arms x seeds, then held-out evaluation and goals"
    )
    parser.add_argument(
        "stage",
        nargs="?",
        default="all",
        choices=["all", "rules", "run", "eval", "report", "eval-one", "retrain"],
    )
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    write_rules(x)
    if args.stage == "eval-one":
        eval_one(x, args.rest[0], int(args.rest[1]))
        return 0
    if args.stage == "retrain":  # runs whose model is gone: trained again (curves checked), then evaluated
        retrain(x, args.rest, script)
        return 0
    stages = {
        "run": lambda: train(x, args.rest or None, script),
        "eval": lambda: evaluate_all(x, script),
        "report": lambda: report(x, goals),
    }
    for stage, fn in stages.items():
        if args.stage in ("all", stage):
            fn()
    return 0
