"""The small-scale reproduction of Sparse-RL's claims: dense vs naive sparse vs Sparse-RL rollouts.

Every arm trains from experiments/base.yaml with the same seeds, data and steps, changing only the algorithm
preset and the KV method. Then each trained model (and the untrained base) is evaluated on the same held-out
prompts under dense inference and under sparse inference with base.yaml's KV setting (R-KV). Results go to
docs/results/study/ (study.json, study.md and PNG curves).

    python experiments/study.py                 # run (or resume) everything; safe to re-run after a kill
    nohup python experiments/study.py --jobs 2 > runs/study/log.txt 2>&1 &   # two arms at a time
    python experiments/study.py --report-only   # rebuild the report from finished arms

Each arm is a `sparserl train` run under runs/study/<arm>; a killed arm resumes from its last checkpoint, and a
finished arm (summary.json present) is not run again. Evaluations are cached as JSON next to the run. With
`--jobs N`, the arms and the base-model evaluation run as N worker processes sharing the CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sparserl.signals import stoppable

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "experiments" / "base.yaml"
ARMS: dict[str, list[str]] = {
    "dense": ["algo.preset=dense"],
    "naive-sparse-rkv": ["algo.preset=naive-sparse", "kv.method=rkv"],
    "sparse-rl-rkv": ["algo.preset=sparse-rl", "kv.method=rkv"],
    "sparse-rl-snapkv": ["algo.preset=sparse-rl", "kv.method=snapkv"],
    "sparse-rl-streaming": ["algo.preset=sparse-rl", "kv.method=streaming_llm"],
}
REQUIRED_ARMS = ["dense", "naive-sparse-rkv", "sparse-rl-rkv", "sparse-rl-snapkv"]
BASE_JOB = "base"  # the untrained model's held-out evaluation, a job of its own


def train_arm(out: Path, arm: str, overrides: list[str], extra: list[str], config: Path = BASE) -> Path:
    """Run (or resume, or skip when finished) one arm from `config` + `overrides`; returns its run directory."""
    run = out / arm
    if (run / "summary.json").is_file():
        return run
    cmd = [sys.executable, "-m", "sparserl.cli", "train"]
    if (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("step-*")):
        cmd += ["--resume", str(run), *extra]
    else:
        cmd += [
            "--config",
            str(config),
            *overrides,
            f"trainer.output_dir={out}",
            f"trainer.run_name={arm}",
            *extra,
        ]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    if rc:
        raise SystemExit(f"arm {arm}: training exited with status {rc} (its error is above)")
    return run


def evaluate_model(spec: str, path: Path, limit: int, samples: int) -> dict:
    """Dense and sparse held-out accuracy of a model on the study task (base.yaml's task, KV setting and
    completion length), cached in `path`."""
    if path.is_file():
        return json.loads(path.read_text())
    from sparserl.config import load_config
    from sparserl.eval.evaluate import evaluate, write_json
    from sparserl.eval.loading import load_eval_model
    from sparserl.tasks import make_task

    cfg = load_config(BASE)
    loaded = load_eval_model(spec)
    result = evaluate(
        loaded.model, loaded.tokenizer, make_task(cfg.task, "test"), kv=cfg.kv, samples=samples, limit=limit,
        max_new_tokens=cfg.rollout.max_new_tokens, seed=1234,
    )  # fmt: skip
    write_json(result, path)
    return result


def eval_path(out: Path, job: str) -> Path:
    return out / "base_eval.json" if job == BASE_JOB else out / job / "heldout_eval.json"


def run_job(out: Path, job: str, extra: list[str], limit: int, samples: int) -> None:
    """Train and evaluate one arm, or evaluate the base model."""
    if job == BASE_JOB:
        evaluate_model("smollm2-135m", eval_path(out, job), limit, samples)
        return
    run = train_arm(out, job, ARMS[job], extra)
    evaluate_model(str(run), eval_path(out, job), limit, samples)


def run_jobs_in_workers(args: argparse.Namespace, jobs: list[str]) -> None:
    """Run each job as a `study.py --worker JOB` process, `args.jobs` at a time, each with its share of the
    cores (torch reads OMP_NUM_THREADS at start-up)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.jobs))}
    fixed = [
        "--out",
        args.out,
        "--eval-prompts",
        str(args.eval_prompts),
        "--eval-samples",
        str(args.eval_samples),
    ]

    def work(job: str) -> int:
        cmd = [sys.executable, __file__, "--worker", job, *fixed, *args.overrides]
        print("$", " ".join(cmd), flush=True)
        return subprocess.run(cmd, env=env, cwd=ROOT).returncode

    with ThreadPoolExecutor(args.jobs) as pool:
        failed = [job for job, rc in zip(jobs, pool.map(work, jobs), strict=True) if rc != 0]
    if failed:
        raise SystemExit(f"study jobs failed: {failed} (re-run the same command to resume)")


def write_atomic(path: Path, text: str) -> None:
    """Write `path` through a temporary file, so a run killed mid-write leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def plain(value: Any) -> Any:
    """JSON's fallback for result files: a numpy or torch scalar as its Python value (a numpy bool would
    otherwise be written as the string "False", which reads back as true), anything else (a path) as text."""
    return value.item() if hasattr(value, "item") else str(value)


def write_with_goals(path: Path, out: dict, goals: dict) -> None:
    """Write a result file as JSON with the experiment's `goals` mapping on top (replacing any it held)."""
    out = {"goals": goals, **{k: v for k, v in out.items() if k != "goals"}}
    write_atomic(path, json.dumps(out, indent=1, default=plain) + "\n")


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )


def mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


CURVES = {  # per-step series kept in study.json: name -> metrics.jsonl key (docs/metrics.md)
    "train_reward": "reward/mean",
    "rejection_rate": "rejection_rate",
    "token_keep_fraction": "rollout_corr/token_keep_fraction",
    "mismatch_kl": "rollout_corr/kl",
    "kv_saved_fraction": "kv/saved_fraction",
}


def heldout(ev: dict, mode: str) -> float | None:
    return ev.get(mode, {}).get(f"mean@{ev.get('samples')}")


def goals(arms: dict[str, dict], base: dict | None) -> dict[str, Any]:
    """The study's three claims, checked on the finished arms (None: an arm it needs is missing)."""
    if not base or "dense" not in arms:
        return {}
    b = heldout(base, "dense")
    gain = {
        a: v["heldout_dense_mean@k"] - b for a, v in arms.items() if v["heldout_dense_mean@k"] is not None
    }
    srl = [a for a in arms if a.startswith("sparse-rl") and a in gain]
    out: dict[str, Any] = {"heldout_dense_gain": gain}
    if gain.get("dense"):
        out["gain_vs_dense"] = {a: g / gain["dense"] for a, g in gain.items()}
        out["sparse_rl_keeps_97pct_of_dense_gain_at_50pct_kv_saved"] = {
            a: out["gain_vs_dense"][a] >= 0.97 and (arms[a]["kv_saved_fraction"] or 0) >= 0.5 for a in srl
        }
    if "naive-sparse-rkv" in gain:
        out["sparse_rl_beats_naive"] = {a: gain[a] > gain["naive-sparse-rkv"] for a in srl}
    dense_sparse = arms["dense"]["heldout_sparse_mean@k"]
    if dense_sparse is not None:
        out["sparse_inference_sparse_rl_ge_dense_trained"] = {
            a: arms[a]["heldout_sparse_mean@k"] >= dense_sparse
            for a in srl
            if arms[a]["heldout_sparse_mean@k"] is not None
        }
    return out


def plot_heldout(arms: dict[str, dict], base: dict | None, path: Path) -> None:
    """Bars: held-out mean@k of the base model and every arm, under dense and under sparse inference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparserl.config import load_config

    names = (["base model"] if base else []) + [
        a for a, v in arms.items() if v["heldout_dense_mean@k"] is not None
    ]
    rows = ([(heldout(base, "dense"), heldout(base, "sparse"))] if base else []) + [
        (arms[a]["heldout_dense_mean@k"], arms[a]["heldout_sparse_mean@k"]) for a in names if a in arms
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r[0] for r in rows], 0.4, label="dense inference")
    kv = load_config(BASE).kv
    ax.bar(
        [i + 0.2 for i in x],
        [r[1] or 0 for r in rows],
        0.4,
        label=f"sparse inference ({kv.method} {kv.budget})",
    )
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_ylabel("held-out mean@k")
    ax.set_title("Held-out accuracy after training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, results_dir: Path, evals: dict[str, dict]) -> dict:
    """Collect per-arm numbers into JSON, a markdown table and a held-out accuracy chart."""
    base = evals.get(BASE_JOB)
    arms = {}
    for arm in ARMS:
        rows = read_metrics(out / arm)
        if not rows:
            continue
        ev = evals.get(arm, {})
        arms[arm] = {
            "steps": len(rows),
            "heldout_dense_mean@k": heldout(ev, "dense"),
            "heldout_sparse_mean@k": heldout(ev, "sparse"),
            "kv_saved_fraction": mean_of(rows, "kv/saved_fraction"),
            "kv_positions_saved_fraction": mean_of(rows, "kv/positions_saved_fraction"),
            "rejection_rate": mean_of(rows, "rejection_rate"),
            "token_keep_fraction": mean_of(rows, "rollout_corr/token_keep_fraction"),
            "mismatch_kl": mean_of(rows, "rollout_corr/kl"),
            "time_rollout_s": mean_of(rows, "time/rollout"),
            "time_score_s": mean_of(rows, "time/score"),
            "time_update_s": mean_of(rows, "time/train"),
            "curves": {name: [r.get(key) for r in rows] for name, key in CURVES.items()},
        }
    summary = {
        "arms": arms,
        "base_model": base,
        "config": str(BASE.relative_to(ROOT)),
        "goals": goals(arms, base),
    }
    write_atomic(results_dir / "study.json", json.dumps(summary, indent=1) + "\n")
    if arms:
        plot_heldout(arms, base, results_dir / "heldout.png")
    lines = [
        "| arm | steps | held-out dense mean@k | held-out sparse mean@k | KV bytes saved | rejected sequences | "
        "masked tokens | mismatch kl | rollout / score / update s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt=".3f"):
        return "" if v is None else format(v, fmt)

    if base:
        lines.append(
            f"| base model | 0 | {f(heldout(base, 'dense'))} | {f(heldout(base, 'sparse'))} | | | | |"
        )
    for arm, v in arms.items():
        times = "/".join(f(v[t], ".0f") for t in ("time_rollout_s", "time_score_s", "time_update_s"))
        masked = None if v["token_keep_fraction"] is None else 1 - v["token_keep_fraction"]
        lines.append(
            f"| {arm} | {v['steps']} | {f(v['heldout_dense_mean@k'])} | {f(v['heldout_sparse_mean@k'])} | "
            f"{f(v['kv_saved_fraction'], '.0%')} | {f(v['rejection_rate'], '.1%')} | {f(masked, '.1%')} | "
            f"{f(v['mismatch_kl'], '.4f')} | {times} |"
        )
    write_atomic(results_dir / "study.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


@stoppable("experiments/study.py", "finished parts are kept; run the same command to go on")
def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(ROOT / "runs" / "study"), help="where the arms' runs go")
    parser.add_argument("--results", default=str(ROOT / "docs" / "results" / "study"), help="report folder")
    parser.add_argument("--arms", nargs="*", default=REQUIRED_ARMS, help=f"arms to run, of {list(ARMS)}")
    parser.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts per evaluation")
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per held-out prompt (mean@k)")
    parser.add_argument("--report-only", action="store_true", help="only rebuild the report")
    parser.add_argument("--jobs", type=int, default=1, help="arms run at once, as worker processes")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)  # one job, started by --jobs
    parser.add_argument(
        "overrides", nargs="*", default=[], help="extra key=value for every arm (e.g. trainer.steps=4)"
    )
    args = parser.parse_args()
    unknown = set(args.arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {list(ARMS)}")
    out, results = Path(args.out), Path(args.results)
    if args.worker:
        run_job(out, args.worker, args.overrides, args.eval_prompts, args.eval_samples)
        return 0
    jobs = [*args.arms, BASE_JOB]
    if not args.report_only:
        if args.jobs > 1:
            run_jobs_in_workers(args, jobs)
        else:
            for job in jobs:
                run_job(out, job, args.overrides, args.eval_prompts, args.eval_samples)
    evals = {
        job: json.loads(eval_path(out, job).read_text()) for job in jobs if eval_path(out, job).is_file()
    }
    report(out, results, evals)
    runs = [str(out / a) for a in args.arms if (out / a / "metrics.jsonl").is_file()]
    if runs:
        subprocess.run(
            [sys.executable, "-m", "sparserl.cli", "plot", *runs, "--out", str(results)],
            check=False,
            cwd=ROOT,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
