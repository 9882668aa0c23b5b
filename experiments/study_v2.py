"""Study v2: do the Sparse-RL and Sparrow claims hold where sparsity bites? Long-context recall
(long_arithmetic, experiments/study_v2.yaml: the answer needs two values stated at the start of a ~360-token
prompt, behind distractors), both sparse families, several seeds.

Stages, each resumable and each kept once done (re-run the same command after a kill):
1. `warmstart`, `scope`, `probe` (experiments/study_v2_setup.py): the starting model, and the scoping run that
   fixes the eviction budget before any training.
2. `run`: the block_topk calibration of the starting model (its tau = 0.86 and tau = 0.75 schedules), the
   starting model's held-out accuracy, then the arms seed by seed (all arms of a seed before the next seed), each
   a `sparserl train` run under runs/study_v2/<arm>-seed<s> followed by its held-out evaluation (128 prompts x 4
   samples under dense inference and R-KV at the chosen budget; the starting model, the dense arm and the Sparrow
   arms also under the tau = 0.86 block_topk schedule), then the rollout throughput of the schedules. The report
   is rewritten after every finished part.
3. `throughput`: that last step alone (the calibration, then dense and both schedules alternated), for a quiet
   machine while the arms are paused; `run` skips it once done.
4. `recall` (experiments/study_v2_recall.py): whether the starting model's samples restate the queried values
   right, dense and under R-KV at the scoped budget (why the eviction arms learn nothing).
   `step-prompts`: the starting model's R-KV reward on each training step's prompts, per seed (whether an
   arm's fall in reward comes from the prompts it drew).
5. `report` (experiments/study_v2_report.py): docs/results/study_v2/study_v2.json and .png from the parts done.

    python experiments/study_v2.py warmstart     # ~15 min on 2 cores
    python experiments/study_v2.py rebuild-warmstart   # elsewhere, from its saved LoRA (runs/study_v2/warmstart-lora)
    python experiments/study_v2.py scope         # ~30 min -> docs/results/study_v2/scoping.json
    nohup python experiments/study_v2.py run > runs/study_v2/log.txt 2>&1 &    # hours per seed on 2 cores
    python experiments/study_v2.py run --seeds 0 --arms dense,sparse-rl-rkv    # a subset first
    python experiments/study_v2.py throughput    # ~10 min; nothing else running
    python experiments/study_v2.py recall --prompts 64 --samples 4   # ~10 min
    python experiments/study_v2.py step-prompts --samples 2          # ~15 min
    python experiments/study_v2.py report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from sparse_parts import cached, calibration_prompts, read_part_if_done, throughput
from study import train_arm, write_atomic
from study_v2_recall import recall, step_prompts_reward
from study_v2_report import report
from study_v2_setup import (
    ARMS,
    BLOCK_TOPK,
    CAL_BIN,
    CONFIG,
    EVAL_PROMPTS,
    EVAL_SAMPLES,
    HELDOUT_SCHEDULES,
    PARTS,
    RESULTS,
    ROOT,
    RUNS,
    STEPS,
    TAU,
    TAU_AGGRESSIVE,
    WARMSTART,
    WARMSTART_LORA,
    eviction_kv,
    probe,
    rebuild_warmstart,
    scope,
    warmstart,
)

from sparserl.signals import stoppable

CAL_BUDGETS = [64, 96, 128, 192, 256]


def load_setting(overrides: list[str] | None = None):
    from sparserl.config import load_config

    return load_config(CONFIG, overrides or [])


def chosen_budget() -> int:
    """The eviction budget the scoping run chose (it must have finished)."""
    path = RESULTS / "scoping.json"
    scoping = json.loads(path.read_text()) if path.is_file() else {}
    if not scoping.get("complete") or scoping.get("chosen_budget") is None:
        raise SystemExit(
            f"{path.relative_to(ROOT)}: the scoping has not chosen a budget; run the scope stage"
        )
    return scoping["chosen_budget"]


def calib_settings(tau: float):
    from sparserl.eval.calibrate import CalibrationSettings

    cfg = load_setting()
    return CalibrationSettings(method="block_topk", kv_options=BLOCK_TOPK, n=8, bin_width=CAL_BIN, tau=tau,
                               max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)  # fmt: skip


def calibration() -> dict:
    """The starting model's exact-alpha table (tau 0.75) and both schedules, once."""

    def make() -> dict:
        from sparserl.eval.calibrate import calibrate, choose_schedule
        from sparserl.models import load_model
        from sparserl.tasks import make_task

        cfg = load_setting()
        model, tok = load_model(cfg.model.spec)
        task = make_task(cfg.task, "test")
        prompts = calibration_prompts(task, tok)
        out = calibrate(model, tok, prompts, CAL_BUDGETS, calib_settings(TAU_AGGRESSIVE))
        p5 = [[b["p5"] for b in row["bins"]] for row in out["table"]]
        out["schedule_tau075"] = out["schedule"]
        out["schedule_tau086"] = choose_schedule(CAL_BUDGETS, p5, CAL_BIN, TAU)[0]
        return out

    return cached(PARTS / "calibration.json", make)


def schedule_files(cal: dict) -> dict[str, str]:
    """The two schedules as kv.schedule files (paths relative to the repository root)."""
    files = {}
    for key in ("schedule_tau086", "schedule_tau075"):
        path = PARTS / f"{key}.json"
        if not path.is_file():
            write_atomic(path, json.dumps({"schedule": cal[key]}) + "\n")
        files[key] = str(path.relative_to(ROOT))
    return files


def accuracy(ev: dict, mode: str) -> dict:
    """Held-out accuracy (mean over prompts of the per-prompt mean reward), its standard error over prompts,
    the mean length and the KV figures of one inference mode of an `evaluate(details=True)` result."""
    per_prompt = [statistics.fmean(e[mode]["rewards"]) for e in ev["examples"]]
    m = ev[mode]
    return {"accuracy": statistics.fmean(per_prompt),
            "stderr": statistics.stdev(per_prompt) / len(per_prompt) ** 0.5, "mean_length": m["mean_length"],
            "kv_saved_fraction": m.get("kv_saved_fraction"), "peak_kv_positions": m.get("peak_kv_positions")}  # fmt: skip


def recall_check(args: argparse.Namespace) -> dict:
    """The starting model's recall table (study_v2_recall.py), dense and under R-KV at the scoped budget; kept
    once done, for the prompts and samples it was run with."""
    path = PARTS / "recall.json"
    done = read_part_if_done(path)
    if done and (done["prompts"], done["samples"]) != (args.prompts, args.samples):
        raise SystemExit(f"{path.relative_to(ROOT)} holds {done['prompts']} prompts x {done['samples']} samples, "
                         f"not {args.prompts} x {args.samples}; delete it to redo")  # fmt: skip

    def make() -> dict:
        from sparserl.tasks import make_task

        cfg = load_setting()
        kv = eviction_kv(cfg, "rkv", chosen_budget())
        return recall(cfg.model.spec, make_task(cfg.task, "test"), kv, args.prompts, args.samples, cfg.rollout,
                      seed=1234)  # fmt: skip

    return cached(path, make)


def step_prompts_check(args: argparse.Namespace) -> dict:
    """The starting model's R-KV reward on each training step's prompts, per seed (study_v2_recall.py)."""

    def make() -> dict:
        from sparserl.tasks import make_task

        cfg = load_setting()
        kv = eviction_kv(cfg, "rkv", chosen_budget())
        return step_prompts_reward(cfg.model.spec, make_task(cfg.task, "train"), kv, args.seeds, STEPS,
                                   cfg.rollout.prompts_per_step, args.samples, cfg.rollout)  # fmt: skip

    return cached(PARTS / "step_prompts.json", make)


def heldout(name: str, model: str, spec: str, budget: int, files: dict[str, str]) -> dict:
    """A model's held-out accuracy (EVAL_PROMPTS x EVAL_SAMPLES, the first test-split prompts) under dense
    inference, R-KV at the scoped budget, and the block_topk schedules HELDOUT_SCHEDULES lists for `model` (an
    arm, or "base")."""

    def make() -> dict:
        from sparserl.engine import KVConfig
        from sparserl.eval.evaluate import evaluate
        from sparserl.eval.loading import load_eval_model
        from sparserl.tasks import make_task

        cfg = load_setting()
        loaded = load_eval_model(spec)
        task = make_task(cfg.task, "test")
        modes = {"rkv": eviction_kv(cfg, "rkv", budget)}
        for key in HELDOUT_SCHEDULES.get(model, ()):
            modes[key.replace("schedule_", "block_topk_")] = KVConfig(
                method="block_topk", schedule=files[key], **BLOCK_TOPK
            )
        out = {"model": spec}
        for i, (mode, kv) in enumerate(modes.items()):
            ev = evaluate(loaded.model, loaded.tokenizer, task, kv=kv, samples=EVAL_SAMPLES, limit=EVAL_PROMPTS,
                          max_new_tokens=cfg.rollout.max_new_tokens, seed=1234, dense=i == 0, details=True)  # fmt: skip
            if i == 0:
                out["dense"] = accuracy(ev, "dense")
            out[mode] = accuracy(ev, "sparse")
            print(name, mode, round(out[mode]["accuracy"], 3), flush=True)
        return out

    return cached(PARTS / "heldout" / f"{name}.json", make)


def arm_overrides(arm: str, seed: int, budget: int, files: dict[str, str], threads: int) -> list[str]:
    fixed = [f"trainer.seed={seed}", f"trainer.steps={STEPS}", f"trainer.threads={threads}"]
    return [o.format(budget=budget, **files) for o in ARMS[arm]] + fixed


def speed(files: dict[str, str], repeats: int) -> dict:
    """Rollout tokens per CPU second of dense and both schedules on the starting model (16 held-out prompts x 8
    samples x the setting's completion length, eos ignored so every arm generates as many tokens)."""

    def make() -> dict:
        from sparserl.models import load_model
        from sparserl.tasks import make_task

        cfg = load_setting()
        _, tok = load_model(cfg.model.spec)
        task = make_task(cfg.task, "test")
        prompts = calibration_prompts(task, tok)
        schedules = {
            "dense": None,
            **{k: json.loads((ROOT / v).read_text())["schedule"] for k, v in files.items()},
        }
        return throughput(schedules, prompts, repeats, model_spec=cfg.model.spec, kv_options=BLOCK_TOPK,
                          max_new_tokens=cfg.rollout.max_new_tokens)  # fmt: skip

    return cached(PARTS / "throughput.json", make)


def run(args: argparse.Namespace) -> None:
    """Everything after the scoping, in order, skipping what is done."""
    budget = chosen_budget()
    if not (WARMSTART / "config.json").is_file():  # run directories are not committed: a fresh copy has none
        raise SystemExit(
            f"{WARMSTART.relative_to(ROOT)}: no starting model; run the warmstart stage (or rebuild-warmstart "
            f"where {WARMSTART_LORA.relative_to(ROOT)} exists) first"
        )
    cal = calibration()
    files = schedule_files(cal)
    heldout("base", "base", load_setting().model.spec, budget, files)
    report()
    for seed in args.seeds:
        for arm in args.arms:
            name = f"{arm}-seed{seed}"
            if (PARTS / "heldout" / f"{name}.json").is_file():
                continue  # finished: its held-out part and curves are committed, its run directory may be gone
            out = train_arm(
                RUNS, name, arm_overrides(arm, seed, budget, files, args.threads), [], config=CONFIG
            )
            heldout(name, arm, os.path.relpath(out, ROOT), budget, files)  # no machine's path in results
            report()
    speed(files, args.repeats)
    report()


@stoppable("experiments/study_v2.py", "finished parts are kept; run the same command to go on")
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "stage",
        choices=[
            "warmstart",
            "rebuild-warmstart",
            "scope",
            "probe",
            "run",
            "throughput",
            "recall",
            "step-prompts",
            "report",
        ],
    )
    p.add_argument(
        "overrides", nargs="*", help="probe, warmstart: config overrides of the setting (key=value)"
    )
    p.add_argument("--seeds", default="0,1,2", help="run, step-prompts: training seeds, comma-separated")
    p.add_argument("--arms", default=",".join(ARMS), help="run: arms, comma-separated, in the order to run")
    p.add_argument("--repeats", type=int, default=3, help="run, throughput: repeats per schedule")
    p.add_argument(
        "--prompts",
        type=int,
        default=48,
        help="scope, probe, warmstart, recall (the report's: 64): the first held-out prompts",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=2,
        help="scope, probe, warmstart, recall (the report's: 4), step-prompts (2): samples per prompt",
    )
    p.add_argument(
        "--mismatch-prompts", type=int, default=8, help="scope: prompts whose samples are scored densely"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=40, help="warmstart: optimizer steps")
    p.add_argument("--sft-batch", type=int, default=8, help="warmstart: problems per step")
    p.add_argument("--sft-lr", type=float, default=3e-4, help="warmstart: AdamW learning rate of the LoRA")
    p.add_argument("--sft-eval-every", type=int, default=2, help="warmstart: steps between reward probes")
    p.add_argument("--sft-target", type=float, default=0.3, help="warmstart: stop at this probe reward")
    args = p.parse_intermixed_args()  # options may come before or after the overrides
    os.chdir(ROOT)  # the setting names its model relative to the repository root
    torch.set_num_threads(args.threads)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.arms = args.arms.split(",")
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if args.stage == "warmstart":
        print(warmstart(args))
    elif args.stage == "rebuild-warmstart":
        print("weights_sha256", rebuild_warmstart())
    elif args.stage == "probe":
        with torch.no_grad():
            print(probe(args))
    elif args.stage == "scope":
        path = RESULTS / "scoping.json"
        if path.is_file() and json.loads(path.read_text()).get("complete"):
            print(f"{path} is complete (the scoping is done once; delete it to redo)")
            return 0
        with torch.no_grad():
            print("chosen budget:", scope(args, path)["chosen_budget"])
    elif args.stage == "run":
        run(args)
    elif args.stage == "recall":
        recall_check(args)
        report()
    elif args.stage == "step-prompts":
        step_prompts_check(args)
    elif args.stage == "throughput":
        print(speed(schedule_files(calibration()), args.repeats))
        report()
    else:
        report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
