"""Study v4: measure whether the Sparse-RL corrections change the update, on a dial of samplers with a
positive control, then train only where it can show. The setting: experiments/study_v4.yaml; the samplers, the
estimators and the decision rules R1-R6: experiments/study_v4_rules.py. Stages A1 and A2 run through
`sparserl bias` (one process per sampler, each resumable). Every stage runs at one thread and is resumable: re-run
the same command after a kill.

    python experiments/study_v4.py setup       # rules, goals, estimate -> docs/results/study_v4/study_v4.json (commit first)
    nohup python experiments/study_v4.py warmstart > /tmp/study_v4_warmstart.log 2>&1 &   # ~0.4 CPU-h
    nohup python experiments/study_v4.py a1 > /tmp/study_v4_a1.log 2>&1 &   # ~2.5 CPU-h, one sampler at a time
    python experiments/study_v4.py pilot       # ~0.4 CPU-h: the dense pilot (learning rate, a training rollout's cost)
    python experiments/study_v4.py a2          # ~12 CPU-h (after A1: the samplers R1 picks)
    python experiments/study_v4.py a2 --processes 2   # the same, each sampler in two one-thread processes
    python experiments/study_v4.py bias-default   # the 15-minute goal: sparserl bias on the embedded default
    python experiments/study_v4.py train       # ~13 CPU-h: stage B or B' (R4 picks; experiments/study_v4_train.py)
    python experiments/study_v4.py train --processes 2   # the same, two one-thread runs side by side
    python experiments/study_v4.py evaluate    # ~2.5 CPU-h: the held-out evaluations, one process per model
    python experiments/study_v4.py evaluate --processes 2   # the same, two one-thread evaluations side by side
    python experiments/study_v4.py report      # the rules judged so far, the goals
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import study_v4_rules as R
import torch
from study_v3 import read, sample, sft_rung, task_of, write
from study_v4_train import eval_one, evaluate, judged_r5, train

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "study_v4.yaml"
RESULTS = ROOT / "docs" / "results" / "study_v4"
JSON = RESULTS / "study_v4.json"
RUNS = ROOT / "runs" / "study_v4"  # kept: never deleted
WARMSTART = RUNS / "warmstart"
V3_WARMSTART = ROOT / "docs" / "results" / "study_v3" / "warmstart.json"
V3_SCOPING = ROOT / "docs" / "results" / "study_v3" / "scoping.json"
RUNG = [12, 1]  # v3's kept rung: 12 operands of 1 digit
# the spec's estimate (CPU-hours), rescaled from measured stages as they finish (`cpu_hours_measured`)
CPU_HOURS = {"warmstart": 0.3, "a1": 2.5, "dense_pilot": 0.4, "a2": 4.8, "train": 13.1, "eval": 2.5,
             "reserve": 1.4, "total": 25.0}  # fmt: skip
COMMIT = "git add docs/results/study_v4 && git commit docs/results/study_v4 -m 'Study v4: <stage> part done'"


def setting(overrides: list[str] = ()):
    from sparserl.config import load_config

    return load_config(CONFIG, list(overrides))


def setup(args) -> None:
    """Write the rules, goals and the estimate (nothing measured) before any stage; never overwrites them."""
    if read(JSON):
        print(f"{JSON.relative_to(ROOT)} exists: the rules are fixed; not rewritten")
        return
    goals = {
        k: {"target": t, "value": None, "met": None, "status": "not measured yet"} for k, t in R.GOALS.items()
    }
    write(JSON, {"goals": goals, "experiment": "Study v4: the bias of the sparse-rollout update",
                 "rules": R.RULES, "samplers": R.SAMPLERS, "controls": list(R.CONTROLS),
                 "cpu_hours_estimate": CPU_HOURS, "commands": __doc__.split("\n\n")[-1].strip().splitlines(),
                 "commit_each_part": COMMIT})  # fmt: skip
    print(f"wrote {JSON.relative_to(ROOT)}")


def reproduced_goal(state: dict) -> dict:
    """The warm start's goal: the same weights as v3's, or a dense probe reward within 0.05 of v3's."""
    v3 = read(V3_WARMSTART)["weights_sha256"]
    same = state.get("weights_sha256") == v3
    gap = state.get("probe_256", {}).get("gap")
    met = same or (gap is not None and abs(gap) <= 0.05)
    return {"value": 0.0 if same else gap, "target": 0.05, "met": met if state.get("done") else None,
            "unit": "|probe reward - v3's 0.398| on 64 probe prompts x 4 (0 when the weights' sha256 equal v3's)",
            "weights_equal_v3": same, "command": "python experiments/study_v4.py warmstart"}  # fmt: skip


def save_warmstart(state: dict) -> None:
    rest = {k: v for k, v in state.items() if k != "goals"}
    write(RESULTS / "warmstart.json", {"goals": {"warm start reproduced": reproduced_goal(rest)}, **rest})


def dense_probe_256(cfg) -> dict:
    """v3's scoping measure of the start model: 64 probe prompts x 4 dense samples (seed 99), mean reward."""
    from sparserl.engine import KVConfig
    from sparserl.models import encode_prompt, load_model

    model, tok = load_model(str(WARMSTART))
    task = task_of(cfg, "probe")
    exs = [task[i] for i in range(64)]
    prompts = [encode_prompt(tok, ex.messages) for ex in exs]
    with torch.no_grad():
        rows = sample(model, tok, cfg, KVConfig(), prompts, task, exs, 4)
    reward = sum(r["reward"] for r in rows) / len(rows)
    v3 = read(V3_SCOPING)["dense"]["reward"]
    return {"reward": reward, "v3_reward": v3, "gap": reward - v3, "samples": len(rows)}


def warmstart(args) -> None:
    """v3's 12x1 rung retrained from the same seed and data (study_v3.sft_rung), then checked against v3."""
    state = read(RESULTS / "warmstart.json", {"command": "python experiments/study_v4.py warmstart"})
    state.pop("goals", None)
    t0 = time.process_time()
    if not state.get("done"):
        cfg = setting([f"task.num_operands={RUNG[0]}", f"task.max_digits={RUNG[1]}"])
        if not sft_rung(list(RUNG), args, state, runs=RUNS, out=WARMSTART, save=save_warmstart, cfg=cfg):
            state.update(
                done=True, failed=True, reason="the rung did not reach v3's start level within its cap"
            )
    if not state.get("failed") and "probe_256" not in state:
        state["probe_256"] = dense_probe_256(setting())
    state["cpu_s_this_process"] = time.process_time() - t0
    save_warmstart(state)
    print(json.dumps(reproduced_goal(state)), "\ncommit:", COMMIT)


# absolute, per SFT step, where the retraining machine rounds floats differently
REBUILT_LOSS_TOLERANCE = 1e-3


def ensure_warmstart(args) -> None:
    """The warm start's model on this machine: a fresh checkout has its record (warmstart.json) but not its
    weights (runs/ is not committed), so they are retrained from the same seed and data (~0.3 CPU-h). On the
    machine that wrote the record they give its SFT losses exactly; another CPU rounds floats differently, so each
    loss must lie within REBUILT_LOSS_TOLERANCE of the committed one, and the largest deviation is kept beside the
    weights (rebuilt.json) for the record."""
    if (WARMSTART / "config.json").is_file():
        return
    committed = read(RESULTS / "warmstart.json", {})
    if not committed.get("done"):
        raise SystemExit("no warm start yet: python experiments/study_v4.py warmstart")
    print("the warm start's weights are not on this machine: retraining them (~0.3 CPU-h)", flush=True)
    state: dict = {}
    cfg = setting([f"task.num_operands={RUNG[0]}", f"task.max_digits={RUNG[1]}"])
    sft_rung(list(RUNG), args, state, runs=RUNS / "rebuild", out=WARMSTART, save=lambda _: None, cfg=cfg)
    key = f"{RUNG[0]}x{RUNG[1]}"
    got, want = state["rungs"][key]["losses"], committed["rungs"][key]["losses"]
    deviation = max(abs(a - b) for a, b in zip(got, want, strict=True))
    if deviation > REBUILT_LOSS_TOLERANCE:
        shutil.rmtree(WARMSTART, ignore_errors=True)
        raise SystemExit(
            f"the retrained warm start's SFT losses are {deviation:.2e} off warmstart.json's: not used"
        )
    write(WARMSTART / "rebuilt.json", {"max_loss_deviation": deviation, "tolerance": REBUILT_LOSS_TOLERANCE,
                                       "exact": got == want})  # fmt: skip
    print(f"warm start rebuilt: SFT losses within {deviation:.2e} of the committed ones", flush=True)


def run_bias(
    stage: str, name: str, batches: int, estimators: str, parts=(), write_report: bool = True
) -> dict | None:
    """`sparserl bias` for one sampler of the dial on the probe rows (4 prompts x 8 per batch), resumable; its
    report copied to docs/results/study_v4/STAGE/NAME.json. `parts` (I/N each): those shares of the batches
    measured side by side, one one-thread process each (`sparserl bias --part`), before the report (if asked)."""
    out, kept = RUNS / stage / name, RESULTS / stage / f"{name}.json"
    cmd = [sys.executable, "-m", "sparserl.cli", "bias", "--config", str(CONFIG), *R.SAMPLERS[name], *probe_rows(),
           "trainer.threads=1", "--prompts", "4", "--batches", str(batches), "--estimators", estimators,
           "--out", str(out), "--resume", "--no-progress"]  # fmt: skip
    print(" ".join(cmd), *(f"[--part {p}]" for p in parts), flush=True)
    processes = [subprocess.Popen([*cmd, "--part", p], cwd=ROOT) for p in parts]
    if any([p.wait() for p in processes]):  # every part waited for before stopping
        raise SystemExit(f"{stage} {name}: a part of the measurement failed (its error is above)")
    if not write_report:
        return None
    subprocess.run(cmd, check=True, cwd=ROOT)
    report = read(out / "bias.json")
    report["goals"] = {}  # a stage's part judges nothing by itself: `report` applies the rules
    write(kept, report)
    print(f"{stage} {name} done ({report['cpu_s']['total'] / 3600:.2f} CPU-h); commit: {COMMIT}", flush=True)
    return report


def split(args) -> list[str]:
    """The --processes option as `sparserl bias --part` shares (none for one process)."""
    n = getattr(args, "processes", 1)
    return [f"{i}/{n}" for i in range(1, n + 1)] if n > 1 else []


def a1(args) -> None:
    """Stage A1: rollout statistics per sampler (32 prompts x 8, no gradients)."""
    ensure_warmstart(args)
    for name in R.SAMPLERS:
        if not read(RESULTS / "a1" / f"{name}.json", {}).get("complete"):
            run_bias("a1", name, R.RULES["a1"]["prompts"] // 4, "none")


def a2(args) -> None:
    """Stage A2: the gradients of naive, sparse-rl, seq-is and smd at K = 12 for the samplers R1's ranking picks
    (fixed in study_v4.json when first chosen), then R2's extension to K = 24 for the top 2 real samplers (for
    every real sampler once R3's second round passed: study_v4_instrument.py)."""
    ensure_warmstart(args)
    reports = {name: read(RESULTS / "a1" / f"{name}.json", {}) for name in R.SAMPLERS}
    missing = [k for k, r in reports.items() if not r.get("complete")]
    if missing:
        raise SystemExit(
            f"stage A1 is not complete ({', '.join(missing)}): python experiments/study_v4.py a1"
        )
    state = read(JSON)
    if "a2_samplers" not in state:
        rows = {k: R.a1_row(k, r) for k, r in reports.items()}
        state["a1_rows"], state["a2_samplers"] = rows, R.a2_samplers(rows)
        write(JSON, state)
    a = R.RULES["a2"]
    estimators = ",".join(e if e != "sparse-rl" else "config" for e in a["estimators"] if e != "naive")
    done = {name: read(RESULTS / "a2" / f"{name}.json", {}) for name in state["a2_samplers"]}
    for name, kept in done.items():  # a sampler whose K = 12 part is committed resumes at its extension
        if not kept.get("complete"):
            done[name] = run_bias("a2", name, a["batches"], estimators, split(args))
    real = [k for k in state["a2_samplers"] if k != "dense" and k not in R.CONTROLS]
    passed = round2_verdict(state) == "corrections matter"
    for name in real if passed else real[:2]:
        # R2's extension (the top 2); once R3's second round passed, every real sampler at K = 24 (its rule)
        if passed or R.r2_extend(done[name]):
            run_bias("a2", name, a["extended_batches"], estimators, split(args))


def pilot(args) -> None:
    """The dense pilot: 10 rollouts of the dense arm on the training rows at v3's pilot learning rate, v3's rule
    for keeping or halving it, and the measured CPU seconds of a training rollout (to rescale stage B's estimate)."""
    import study_v3_rules as R3
    from study import train_arm
    from study_v3 import curves

    path = RESULTS / "pilot.json"
    if read(path):
        print("pilot done:", read(path)["lr"])
        return
    ensure_warmstart(args)
    lr = R3.RULES["pilot"]["lr"]
    overrides = [
        "algo.preset=dense",
        "trainer.seed=0",
        "trainer.steps=10",
        "trainer.threads=1",
        f"optim.lr={lr}",
    ]
    run = train_arm(RUNS, "pilot-dense", overrides, [], config=CONFIG)
    c = curves(run)
    chosen, why = R3.pilot_lr([v for v in c["kl_ref"] if v is not None], c["reward"], lr)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cpu = [r["time/step_cpu"] for r in rows if "time/step_cpu" in r]
    write(path, {"goals": {}, "lr": chosen, "reason": why, "curves": c, "cpu_s_per_rollout": cpu,
                 "command": "python experiments/study_v4.py pilot"})  # fmt: skip
    print("lr", chosen, why, "\ncommit:", COMMIT)


def bias_default(args) -> None:
    """The goal's benchmark: `sparserl bias trainer.threads=1 --batches 4` on the embedded default, its whole
    process's CPU seconds (the child's rusage: model load, sampling, gradients, report) and wall time."""
    out = RUNS / "bias-default"
    cmd = [sys.executable, "-m", "sparserl.cli", "bias", "trainer.threads=1", "--batches", "4", "--out", str(out),
           "--no-progress"] + (["--resume"] if out.exists() else [])  # fmt: skip
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = read(out / "bias.json")
    report["process"] = {"command": " ".join(cmd[1:]), "wall_s": time.time() - t0,
                         "cpu_s": usage.ru_utime + usage.ru_stime, "resumed": "--resume" in cmd}  # fmt: skip
    report["goals"] = {}  # judged in study_v4.json (`report`)
    write(RESULTS / "bias_default.json", report)
    print(report["process"])


def round2_verdict(state: dict) -> str | None:
    """Sparse-RL's verdict on the temperature-1.3 control's fresh batches (R3's second round), once judged."""
    return state.get("instrument_check", {}).get("round2", {}).get("verdicts", {}).get("config")


def report(args) -> None:
    """The rules judged from the stage files so far, and the goals, into study_v4.json (its rules unchanged)."""
    state = read(JSON)
    a1 = {k: read(RESULTS / "a1" / f"{k}.json", {}) for k in R.SAMPLERS}
    a2 = {k: read(RESULTS / "a2" / f"{k}.json", {}) for k in state.get("a2_samplers", [])}
    default = read(RESULTS / "bias_default.json", {})
    whole = default.get("process", {})
    minutes = whole["cpu_s"] / 60 if default.get("complete") and not whole.get("resumed", True) else None
    round2 = round2_verdict(state)
    judged = R.judge(a1, a2, minutes, round2)
    judged["R5"] = judged_r5()
    ws = read(RESULTS / "warmstart.json", {}).get("goals", {}).get("warm start reproduced", {})
    names = list(R.GOALS)
    r3 = judged["R3"]
    count = sum(judged[k]["status"] == "judged" for k in ("R1", "R2", "R3", "R4", "R5", "R6"))
    state["goals"] = {
        names[0]: {"value": r3["verdict"], "target": "corrections matter", "met": r3["passed"],
                   "command": "python experiments/study_v4_instrument.py round2" if round2 else
                   "python experiments/study_v4.py a2", **({} if r3["verdict"] else {"status": "not run yet"})},
        names[1]: {"value": count, "target": 6, "met": count == 6, "command": "python experiments/study_v4.py report",
                   "unit": "rules of R1-R6 judged"},
        names[2]: {"value": minutes, "target": 15.0, "met": minutes <= 15.0 if minutes is not None else None,
                   "unit": "CPU minutes of `sparserl bias trainer.threads=1 --batches 4` on the embedded default",
                   "command": "python experiments/study_v4.py bias-default"},
        names[3]: {k: ws.get(k) for k in ("value", "target", "met", "unit", "command")},
    }  # fmt: skip
    state["judged"] = judged
    write(JSON, state)
    print(json.dumps(state["goals"], indent=1))


def probe_rows() -> list[str]:
    """Overrides that make the task's rows v3's probe set (task seed 2, test split)."""
    spec = __import__("study_v3_rules").ROW_SETS["probe"]
    return [f"task.seed={spec['task_seed']}", f"task.split={spec['split']}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["setup", "warmstart", "a1", "pilot", "a2", "bias-default", "train", "evaluate",
                                      "eval-one", "report"])  # fmt: skip
    p.add_argument("model", nargs="*", help="eval-one only: NAME SPEC (the `evaluate` stage calls it)")
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=3e-4)
    p.add_argument("--processes", type=int, default=1, help="a2: measure each sampler in this many one-thread "
                   "processes side by side (sparserl bias --part); train and evaluate: this many one-thread runs "
                   "side by side; the numbers do not change")  # fmt: skip
    args = p.parse_args()
    os.chdir(ROOT)  # the setting names its model relative to the repository root
    torch.set_num_threads(1)
    stages = {"setup": setup, "warmstart": warmstart, "a1": a1, "pilot": pilot, "a2": a2, "bias-default": bias_default,
              "train": train, "evaluate": evaluate, "eval-one": lambda a: eval_one(*a.model), "report": report}  # fmt: skip
    stages[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
