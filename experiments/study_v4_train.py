"""Study v4, stage B (or B') and its held-out evaluation, driven by experiments/study_v4.py:

    python experiments/study_v4.py train      # ~13 CPU-h: 3 arms x 4 seeds x 28 rollouts, one run at a time
    python experiments/study_v4.py train --processes 2   # the same, two one-thread runs side by side
    python experiments/study_v4.py evaluate   # ~2.5 CPU-h: the warm start and the 12 trained models, one process each
    python experiments/study_v4.py evaluate --processes 2   # the same, two one-thread evaluations side by side
    python experiments/study_v4.py train && python experiments/study_v4.py evaluate   # beside an `evaluate`:
                                              # evaluations started apart share the models by claim (runs/)
    python experiments/study_v4.py report     # R5 and the validity gate, once every evaluation is in

The arms and the sampler come from R4 (study_v4_r5.plan), fixed in study_v4.json when first chosen. Every run is a
`sparserl train` of experiments/study_v4.yaml that resumes from its last checkpoint after a kill; each finished
run's metrics.jsonl is copied to docs/results/study_v4/b/NAME.jsonl, each evaluation to .../heldout/NAME.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import study_v4_r5 as B
import study_v4_rules as R
from study_v3 import read, task_of, write

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "study_v4"
JSON = RESULTS / "study_v4.json"
RUNS = ROOT / "runs" / "study_v4"
CONFIG = ROOT / "experiments" / "study_v4.yaml"
CLAIMS = RUNS / "heldout-claims"  # one file per evaluation in progress, holding its evaluator's pid
COMMIT = "git add docs/results/study_v4 && git commit docs/results/study_v4 -m 'Study v4: <stage> part done'"


def stage_plan() -> dict:
    """Stage B's plan, chosen from the judged R4 the first time and kept in study_v4.json after."""
    state = read(JSON)
    if "stage_b" not in state:
        if "judged" not in state:
            raise SystemExit("run `python experiments/study_v4.py report` after stage A2 first")
        a2 = {k: read(RESULTS / "a2" / f"{k}.json", {}) for k in state["a2_samplers"]}
        state["stage_b"] = B.plan(state["judged"], a2)
        write(JSON, state)
    return state["stage_b"]


def run_names(p: dict) -> list[str]:
    """Seed-major, so that a stop leaves whole seeds of all three arms (the pairs the tests read)."""
    return [f"{arm}-s{seed}" for seed in p["seeds"] for arm in p["arms"]]


def side_by_side(names: list[str], work, processes: int) -> None:
    """work(name) for every name, `processes` at a time in name order; a failure lets the running ones finish,
    starts no other, and is raised."""
    failed = threading.Event()

    def unless_failed(name: str) -> None:
        if failed.is_set():
            return
        try:
            work(name)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max(1, processes)) as pool:
        runs = [pool.submit(unless_failed, name) for name in names]
    for run in runs:
        if run.exception() is not None:
            raise run.exception()


def train(args) -> None:
    """Every arm and seed in seed-major order (resumed, or skipped when its copy is committed), `--processes`
    one-thread runs side by side; a failed run lets the running ones finish and starts no other."""
    p = stage_plan()
    lr = read(RESULTS / "pilot.json")["lr"]
    pending = [n for n in run_names(p) if not (RESULTS / "b" / f"{n}.jsonl").is_file()]
    side_by_side(pending, lambda name: train_one(p, lr, name), getattr(args, "processes", 1))


def train_one(p: dict, lr: float, name: str) -> None:
    """One arm and seed: `sparserl train` (resumed from its last checkpoint), its metrics copied for commit."""
    from study import train_arm

    arm, seed = name.rsplit("-s", 1)
    overrides = [*p["arms"][arm], f"trainer.seed={seed}", f"trainer.steps={p['rollouts']}", f"optim.lr={lr}"]
    run = train_arm(RUNS / "b", name, overrides, [], config=CONFIG)
    dest = RESULTS / "b" / f"{name}.jsonl"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(run / "metrics.jsonl", dest)
    print(f"stage {p['stage']} {name} done; commit: {COMMIT}", flush=True)


def models(p: dict) -> dict[str, str]:
    """The warm start and every finished run, by name."""
    out = {"start": str((RUNS / "warmstart").relative_to(ROOT))}
    out |= {
        n: str((RUNS / "b" / n).relative_to(ROOT))
        for n in run_names(p)
        if (RESULTS / "b" / f"{n}.jsonl").is_file()
    }
    return out


def evaluate(args) -> None:
    """Each model held out in its own one-thread process (`eval-one`), `--processes` side by side, skipped when
    its JSON exists or another `evaluate` holds its claim."""
    p = stage_plan()
    pending = {n: spec for n, spec in models(p).items() if not (RESULTS / "heldout" / f"{n}.json").is_file()}

    def held_out(name: str) -> None:
        if (RESULTS / "heldout" / f"{name}.json").is_file() or not claim(name):
            return  # done or in progress elsewhere since this evaluate started
        cmd = [sys.executable, str(ROOT / "experiments" / "study_v4.py"), "eval-one", name, pending[name]]
        try:
            if subprocess.run(cmd, cwd=ROOT).returncode:
                raise SystemExit(f"the held-out evaluation of {name} failed: {' '.join(cmd[1:])}")
        finally:
            (CLAIMS / name).unlink(missing_ok=True)
        print(f"held out {name}; commit: {COMMIT}", flush=True)

    side_by_side(list(pending), held_out, getattr(args, "processes", 1))


def claim(name: str) -> bool:
    """Take the model for this process, so that two `evaluate` commands started apart (one after `train`, one
    beside it) share the models instead of repeating them; a claim whose process has died is taken over."""
    CLAIMS.mkdir(parents=True, exist_ok=True)
    path = CLAIMS / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(path.read_text() or 0), 0)
            return False  # its evaluator is alive
        except (ProcessLookupError, ValueError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return claim(name)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def eval_one(name: str, spec: str) -> None:
    """One model on the held-out rows (R5: 128 prompts x 4), dense and, for an evicting sampler, under that
    sampler's KV setting; the training setting's completion length, the evaluation seed fixed."""
    from sparserl.config import load_config
    from sparserl.eval.evaluate import evaluate as run_eval
    from sparserl.eval.loading import load_eval_model

    p, held = stage_plan(), R.RULES["R5"]["heldout"]
    cfg = load_config(CONFIG, list(p["arms"]["sparse-rl"]))
    loaded = load_eval_model(spec)
    ev = run_eval(loaded.model, loaded.tokenizer, task_of(cfg, "heldout"), kv=cfg.kv if p["evicting"] else None,
                  samples=held["samples"], limit=held["prompts"], max_new_tokens=cfg.rollout.max_new_tokens,
                  seed=1234)  # fmt: skip
    # a part: its goals are R5's, judged in study_v4.json once every model is held out
    write(RESULTS / "heldout" / f"{name}.json", {"goals": {}, "model": spec, **ev})


def judged_r5() -> dict:
    """R5 and the validity gate when every evaluation is in, else 'not run' with what is missing."""
    state = read(JSON)
    p = state.get("stage_b")
    if p is None:
        return {
            "status": "not run",
            "reason": "stage B has not been planned (python experiments/study_v4.py train)",
        }
    names = ["start", *run_names(p)]
    heldout = {n: read(RESULTS / "heldout" / f"{n}.json", {}) for n in names}
    missing = [n for n, h in heldout.items() if not h]
    if missing:
        return {"status": "not run", "reason": f"held-out evaluations missing: {', '.join(missing)}"}
    curves = {
        n: [json.loads(x) for x in (RESULTS / "b" / f"{n}.jsonl").read_text().splitlines()] for n in names[1:]
    }
    a1 = read(RESULTS / "a1" / f"{p['sampler']}.json")
    a2 = read(RESULTS / "a2" / f"{p['sampler']}.json")
    out = B.judge_r5(p, heldout, curves, a1, a2)
    plot_stage_b(p, curves, heldout, RESULTS / "b.png")
    out["plot"] = "b.png"
    r3 = state.get("judged", {}).get("R3", {}).get("passed")
    out["validity"]["R3_passed"] = {"value": r3, "passed": bool(r3)}
    out["validity"]["passed"] = out["validity"]["passed"] and bool(r3)
    return out


def plot_stage_b(p: dict, curves: dict[str, list[dict]], heldout: dict[str, dict], path: Path) -> None:
    """The curves R5's validity gate reads (training reward, the sampler's per-token k3 against pi_old: 0 for the
    dense arm), each arm's mean over seeds with every seed faint, and each model's held-out accuracy by seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for color, arm in zip(("C0", "C1", "C2"), p["arms"], strict=False):
        for ax, key in zip(axes[:2], ("reward/mean", "rollout_corr/k3_kl"), strict=True):
            runs = [[r.get(key) for r in curves[f"{arm}-s{s}"]] for s in p["seeds"]]
            for run in runs:
                ax.plot(range(1, len(run) + 1), run, color=color, alpha=0.25, lw=0.8)
            ax.plot(range(1, len(runs[0]) + 1), [sum(x) / len(x) for x in zip(*runs, strict=True)],
                    color=color, lw=2, label=arm)  # fmt: skip
            ax.set(title=key, xlabel="rollout")
        axes[2].plot(p["seeds"], [heldout[f"{arm}-s{s}"]["dense"]["mean@4"] for s in p["seeds"]], "o-",
                     color=color, label=arm)  # fmt: skip
    axes[2].axhline(heldout["start"]["dense"]["mean@4"], color="gray", ls="--", label="warm start")
    axes[2].set(title="held-out mean@4 (dense)", xlabel="seed", xticks=p["seeds"])
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Study v4, stage {p['stage']} at {p['sampler']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
