"""Study v3: the Sparse-RL claims where eviction hits the reasoning. Long worked sums (arithmetic, 12
operands, '+'; experiments/study_v3.yaml), an R-KV budget a little above the prompt chosen by a rule fixed in
advance, dense / naive R-KV / Sparse-RL R-KV x seeds 0-3, statistics paired by seed. The task's answers, the
restate regex and every decision rule: experiments/study_v3_rules.py. Every stage is resumable (re-run the same
command after a kill) and runs at one thread.

    python experiments/study_v3.py setup       # the rules and goals -> docs/results/study_v3/study_v3.json (commit first)
    nohup python experiments/study_v3.py warmstart > /tmp/study_v3_warmstart.log 2>&1 &   # ~2 CPU-h (ladder: <= 6)
    python experiments/study_v3.py scope       # ~1.5 CPU-h -> docs/results/study_v3/scoping.json
    python experiments/study_v3.py pilot       # ~0.7 CPU-h -> docs/results/study_v3/pilot.json
    nohup python experiments/study_v3.py run > /tmp/study_v3_run.log 2>&1 &   # ~20 CPU-h, 12 runs
    python experiments/study_v3.py eval        # ~4 CPU-h, each model in its own process
    python experiments/study_v3.py report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import study_v3_rules as R
import torch
from study import read_metrics, train_arm, write_atomic
from study_v2_setup import eviction_kv, mismatch, weight_checksum

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "study_v3.yaml"
RESULTS = ROOT / "docs" / "results" / "study_v3"
RUNS = ROOT / "runs" / "study_v3"  # kept: never deleted
WARMSTART = RUNS / "warmstart"
JSON = RESULTS / "study_v3.json"
BASE_MODEL = "smollm2-135m"
ARMS = {
    "dense": ["algo.preset=dense"],
    "naive-sparse-rkv": ["algo.preset=naive-sparse", "kv.method=rkv", "kv.budget={budget}"],
    "sparse-rl-rkv": ["algo.preset=sparse-rl", "kv.method=rkv", "kv.budget={budget}"],
}
CPU_HOURS = {"warmstart": "2 (up to 6 if the ladder runs every rung to its cap)", "scope": 1.5, "pilot": 0.7,
             "run": 20, "eval": 4, "total": "about 28 (the issue's estimate: 25)"}  # fmt: skip
# per-rollout metrics every claim reads (docs/metrics.md); the whole metrics.jsonl of each run is committed
CURVE_KEYS = {"reward": "reward/mean", "length": "length/mean", "truncated": "length/truncated_frac",
              "kl_ref": "actor/kl_ref", "grad_norm": "actor/grad_norm", "entropy_estimate": "rollout_corr/rollout_log_ppl",
              "token_keep": "rollout_corr/token_keep_fraction", "rejection": "rejection_rate",
              "tis_truncated": "rollout_corr/tis_truncated_fraction", "mismatch_k3": "rollout_corr/k3_kl"}  # fmt: skip
COMMIT = "git add docs/results/study_v3 && git commit docs/results/study_v3 -m 'Study v3: <stage> part done'"


def read(path: Path, default=None):
    return json.loads(path.read_text()) if path.is_file() else default


def write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def save_warmstart(state: dict) -> None:
    """warmstart.json with its goal (the start level, study_v3_rules.warmstart_goals) as measured so far."""
    rest = {k: v for k, v in state.items() if k != "goals"}  # a state read back carries the old goals
    write(RESULTS / "warmstart.json", {"goals": R.warmstart_goals(rest), **rest})


def rung_overrides(rung: list[int]) -> list[str]:
    return [f"task.num_operands={rung[0]}", f"task.max_digits={rung[1]}"]


RESCOPE_OPERANDS = 16  # the budget rule's fallback: no budget qualified, raise the operands, re-scope once


def scoping_paths() -> list[Path]:
    """The scoping results in the order the rule takes them: the warm start's rung, then the re-scope."""
    return [RESULTS / "scoping.json", RESULTS / f"scoping_{RESCOPE_OPERANDS}_operands.json"]


def rescoped() -> bool:
    """True once the first scoping chose no budget: every later stage runs at RESCOPE_OPERANDS operands."""
    first = read(scoping_paths()[0], {})
    return bool(first.get("complete")) and first.get("chosen_budget") is None


def setting(overrides: list[str] = ()):
    from sparserl.config import load_config

    state = read(RESULTS / "warmstart.json", {})
    rung = rung_overrides(state.get("rung", R.LADDER[0]))
    more = [f"task.num_operands={RESCOPE_OPERANDS}"] if rescoped() else []
    return load_config(CONFIG, rung + more + list(overrides))


def task_of(cfg, row_set: str):
    """The task rows of one of the disjoint sets (study_v3_rules.ROW_SETS)."""
    from sparserl.tasks import make_task

    spec = R.ROW_SETS[row_set]
    return make_task(dataclasses.replace(cfg.task, seed=spec["task_seed"]), spec["split"])


def disjointness(cfg, sft_rows: int, probe_rows: int) -> dict:
    """Expressions of the rows each set can use, checked pairwise for overlap."""
    sizes = {"sft": sft_rows, "rl_train": len(task_of(cfg, "rl_train")), "probe": probe_rows, "heldout": 128}
    sets = {k: {task_of(cfg, k)[i].meta["expression"] for i in range(n)} for k, n in sizes.items()}
    names = list(sets)
    overlaps = {f"{a}&{b}": len(sets[a] & sets[b]) for i, a in enumerate(names) for b in names[i + 1 :]}
    return {"rows": sizes, "overlaps": overlaps, "disjoint": not any(overlaps.values())}


def setup(args) -> None:
    """Write the rules and goals (not measured) before any run; never overwrites them."""
    if read(JSON):
        print(f"{JSON.relative_to(ROOT)} exists: the rules are fixed; not rewritten")
        return
    cfg = setting()
    goals = {
        k: {"target": t, "value": None, "met": False, "reason": "not measured yet"}
        for k, t in R.GOALS.items()
    }
    write(JSON, {"goals": goals, "experiment": "Study v3: Sparse-RL claims 1-3 with eviction in the answer",
                 "rules": R.RULES, "row_sets": R.ROW_SETS, "ladder": R.LADDER, "restate_regex": R.RESTATE_RE.pattern,
                 "arms": ARMS, "curve_keys": CURVE_KEYS, "cpu_hours_estimate": CPU_HOURS,
                 "disjointness": disjointness(cfg, R.RULES["warmstart"]["cap"] * args.sft_batch, 64),
                 "commands": __doc__.split("\n\n")[-1].strip().splitlines(), "commit_each_part": COMMIT})  # fmt: skip
    print(f"wrote {JSON.relative_to(ROOT)}")


def probe(model, tok, cfg, prompts: int, samples: int) -> dict:
    """Dense reward, mean length and restate share of `model` on the first probe rows."""
    from sparserl.eval.evaluate import evaluate

    r = cfg.rollout
    ev = evaluate(model, tok, task_of(cfg, "probe"), samples=samples, limit=prompts, seed=1234, details=True,
                  max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=1.0)  # fmt: skip
    texts = [t for e in ev["examples"] for t in e["dense"]["completions"]]
    return {"dense_reward": ev["dense"][f"mean@{samples}"], "mean_length": ev["dense"]["mean_length"],
            "truncated_share": ev["dense"].get("truncated_share"), "restate_share": R.restate_share(texts)}  # fmt: skip


def sft_batch(tok, cfg, start: int, size: int):
    from sparserl.models import encode_prompt

    task = task_of(cfg, "sft")
    rows = [task[i] for i in range(start, start + size)]
    prompts = [encode_prompt(tok, ex.messages) for ex in rows]
    answers = [tok(R.worked_answer(R.operands_of(ex.meta["expression"]), R.sft_style(start + j)),
                   add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for j, ex in enumerate(rows)]  # fmt: skip
    return prompts, answers


def sft_rung(
    rung: list[int],
    args,
    state: dict,
    runs: Path = RUNS,
    out: Path = WARMSTART,
    save=save_warmstart,
    cfg=None,
) -> bool:
    """LoRA SFT on one rung of the ladder, resumable from its last probe; True if a probe met the target.
    `runs` holds the rung's checkpoints, `out` the merged model, `save(state)` records progress and `cfg` is
    the rung's setting (study v4 reproduces v3's rung into its own folders, in its own setting)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from sparserl.engine import completion_logprobs
    from sparserl.models import load_model, prepare_for_training

    w, cfg = R.RULES["warmstart"], cfg or setting(rung_overrides(rung))
    ckpt = runs / f"warmstart-{rung[0]}x{rung[1]}"
    model, tok = load_model(BASE_MODEL)
    prepare_for_training(model)
    torch.manual_seed(0)
    if (ckpt / "adapter_config.json").is_file():
        peft = PeftModel.from_pretrained(model, ckpt, is_trainable=True)
    else:
        peft = get_peft_model(model, LoraConfig(r=cfg.model.lora_r, lora_alpha=cfg.model.lora_alpha,
                                                target_modules="all-linear"))  # fmt: skip
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=args.sft_lr)
    if (ckpt / "optimizer.pt").is_file():
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt"))
    rec = state.setdefault("rungs", {}).setdefault(
        f"{rung[0]}x{rung[1]}", {"steps": 0, "losses": [], "probes": []}
    )
    t0 = time.perf_counter()
    while rec["steps"] < w["cap"]:
        prompts, answers = sft_batch(tok, cfg, rec["steps"] * args.sft_batch, args.sft_batch)
        logp, mask = completion_logprobs(peft.get_base_model(), prompts, answers)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rec["steps"] += 1
        rec["losses"].append(loss.item())
        print(f"rung {rung} sft step {rec['steps']}: loss {loss.item():.3f}", flush=True)
        if rec["steps"] % w["probe_every"]:
            continue
        with torch.no_grad():
            rec["probes"].append({"step": rec["steps"], **probe(peft.get_base_model(), tok, cfg, 32, 2)})
        print(rec["probes"][-1], flush=True)
        peft.save_pretrained(ckpt)
        torch.save(opt.state_dict(), ckpt / "optimizer.pt")
        rec["cpu_s"] = rec.get("cpu_s", 0.0) + time.perf_counter() - t0
        t0 = time.perf_counter()
        save(state)
        if R.sft_done(rec["probes"][-1]):
            merged = peft.merge_and_unload().eval()
            merged.save_pretrained(out)
            tok.save_pretrained(out)
            state.update(rung=rung, done=True, weights_sha256=weight_checksum(merged), kept=rec["probes"][-1])
            save(state)
            return True
    return False


def warmstart(args) -> None:
    """The warm start with its fallback ladder (study_v3_rules.RULES['warmstart'])."""
    state = read(RESULTS / "warmstart.json", {"command": "python experiments/study_v3.py warmstart"})
    if state.get("done"):
        print("warm start done:", state["kept"])
        return
    for rung in R.LADDER:
        if sft_rung(list(rung), args, state):
            print("warm start done on rung", rung, state["kept"], "\ncommit:", COMMIT)
            return
    state.update(
        done=True, failed=True, reason="no rung of the ladder reached the start level: claims not testable"
    )
    save_warmstart(state)


def sample(model, tok, cfg, kv, prompts, task, exs, samples: int) -> list[dict]:
    """Samples of `prompts` under `kv`: reward, length, style, sampler log-probs."""
    from sparserl.engine import RolloutEngine

    r = cfg.rollout
    out = RolloutEngine(model, tok, kv).generate(prompts, n=samples, max_new_tokens=r.max_new_tokens,
                                                 temperature=r.temperature, seed=99)  # fmt: skip
    rows = []
    for s in out:
        text = tok.decode(s.completion_ids, skip_special_tokens=True)
        rows.append({"prompt": s.prompt_index, "ids": s.completion_ids, "logprobs": s.logprobs,
                     "reward": task.reward(text, exs[s.prompt_index]),
                     "text": text, "restate": R.restates(text), "length": len(s.completion_ids)})  # fmt: skip
    return rows


def scope_summary(rows: list[dict], prompt_lens: list[int], bound: int | None) -> dict:
    by = {st: [r["reward"] for r in rows if r["restate"] == st] for st in (False, True)}
    out = {"reward": statistics.fmean(r["reward"] for r in rows), "restate_share": R.restate_share([r["text"] for r in rows]),
           "reward_running": statistics.fmean(by[False]) if by[False] else None,
           "reward_restate": statistics.fmean(by[True]) if by[True] else None,
           "mean_length": statistics.fmean(r["length"] for r in rows),
           "truncated_share": statistics.fmean(r["length"] >= 320 for r in rows)}  # fmt: skip
    if bound:
        out["retained_saving"] = R.retained_saving(
            [prompt_lens[r["prompt"]] for r in rows], [r["length"] for r in rows], bound
        )
    return out


def scope(args) -> None:
    """The budget rule on the starting model (study_v3_rules.RULES['budget']), each budget saved as it ends."""
    from sparserl.engine import KVConfig, score
    from sparserl.models import encode_prompt, load_model

    path = scoping_paths()[1] if rescoped() else scoping_paths()[0]
    cfg = setting()
    out = read(path, {"command": "python experiments/study_v3.py scope", "rows": {}})
    out["operands"] = cfg.task.num_operands
    if out.get("complete"):
        print("scoping done: budget", out["chosen_budget"])
        return
    model, tok = load_model(cfg.model.spec)
    task = task_of(cfg, "probe")
    exs = [task[i] for i in range(64)]
    prompts = [encode_prompt(tok, ex.messages) for ex in exs]
    lens = [len(p) for p in prompts]
    out["max_prompt"], out["candidates"] = max(lens), R.candidate_budgets(max(lens))
    with torch.no_grad():
        if "dense" not in out:
            out["dense"] = scope_summary(
                sample(model, tok, cfg, KVConfig(), prompts, task, exs, 4), lens, None
            )
            write(path, out)
        for budget in out["candidates"]:
            if str(budget) in out["rows"]:
                continue
            rows = sample(model, tok, cfg, eviction_kv(cfg, "rkv", budget), prompts, task, exs, 4)
            sub = [r for r in rows if r["prompt"] < args.mismatch_prompts]
            dense_lp = score(model, [prompts[r["prompt"]] for r in sub], [r["ids"] for r in sub])
            row = {**scope_summary(rows, lens, budget + cfg.kv.interval - 1),
                   **mismatch([r["logprobs"] for r in sub], dense_lp)}  # fmt: skip
            for st in ("running", "restate"):
                d = out["dense"][f"reward_{st}"]
                row[f"ratio_{st}"] = (
                    row[f"reward_{st}"] / d if d and row[f"reward_{st}"] is not None else None
                )
            out["rows"][str(budget)] = row
            write(path, out)
            print(budget, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}, flush=True)
    out["chosen_budget"] = R.choose_budget(
        {int(b): r for b, r in out["rows"].items()}, out["dense"]["reward"]
    )
    out["complete"] = True
    out = {"goals": scoping_goals(out), **{k: v for k, v in out.items() if k != "goals"}}
    write(path, out)
    again = out["chosen_budget"] is None and path == scoping_paths()[0]
    print("chosen budget:", out["chosen_budget"], f"at {out['operands']} operands")
    if again:  # the rule's fallback, once: the same measurement at RESCOPE_OPERANDS operands
        print(f"no budget qualified: re-scoping at {RESCOPE_OPERANDS} operands")
        scope(args)
    elif out["chosen_budget"] is None:
        print("no budget qualified after the re-scope either: by the committed rule the claims are untestable at "
              "135M; stop here and report (python experiments/study_v3.py report)")  # fmt: skip
    print("commit:", COMMIT)


def scoping_goals(out: dict) -> dict:
    """The scoping's one goal: a budget qualifies by the committed rule (study_v3_rules.RULES['budget'])."""
    return {
        "an R-KV budget qualifies by the committed rule": {
            "value": out["chosen_budget"],
            "target": R.RULES["budget"]["rule"],
            "met": out["chosen_budget"] is not None,
            "command": "python experiments/study_v3.py scope",
        }
    }


def budget() -> int:
    path = scoping_paths()[1] if rescoped() else scoping_paths()[0]
    s = read(path, {})
    if not s.get("complete") or s.get("chosen_budget") is None:
        raise SystemExit(f"{path}: no budget chosen; run the scope stage (or report, if the "
                         "re-scope chose none)")  # fmt: skip
    return s["chosen_budget"]


def arm_overrides(arm: str, seed: int, lr: float, steps: int = 40) -> list[str]:
    rung = read(RESULTS / "warmstart.json", {}).get("rung", R.LADDER[0])
    b = budget() if "{budget}" in " ".join(ARMS[arm]) else 0
    more = [f"task.num_operands={RESCOPE_OPERANDS}"] if rescoped() else []
    return [o.format(budget=b) for o in ARMS[arm]] + rung_overrides(rung) + more + [
        f"trainer.seed={seed}", f"trainer.steps={steps}", "trainer.threads=1", f"optim.lr={lr}"]  # fmt: skip


def curves(run: Path) -> dict[str, list]:
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    return {k: [r.get(key) for r in rows] for k, key in CURVE_KEYS.items()}


def pilot(args) -> None:
    path = RESULTS / "pilot.json"
    if read(path):
        print("pilot done:", read(path)["lr"])
        return
    lr = R.RULES["pilot"]["lr"]
    run = train_arm(RUNS, "pilot-dense", arm_overrides("dense", 0, lr, 10), [], config=CONFIG)
    c = curves(run)
    chosen, why = R.pilot_lr([v for v in c["kl_ref"] if v is not None], c["reward"], lr)
    shutil.copy(run / "metrics.jsonl", RESULTS / "runs" / "pilot-dense.jsonl")
    write(path, {"lr": chosen, "reason": why, "curves": c, "command": "python experiments/study_v3.py pilot"})
    print("lr", chosen, why, "\ncommit:", COMMIT)


def run(args) -> None:
    lr = (read(RESULTS / "pilot.json") or {}).get("lr") or sys.exit("run the pilot stage first")
    for seed in args.seeds:
        for arm in ARMS:
            name, dest = f"{arm}-s{seed}", RESULTS / "runs" / f"{arm}-s{seed}.jsonl"
            if dest.is_file():
                continue
            out = train_arm(RUNS, name, arm_overrides(arm, seed, lr), [], config=CONFIG)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(out / "metrics.jsonl", dest)
            print(f"{name} done; commit: {COMMIT}", flush=True)


def eval_one(name: str, spec: str) -> None:
    """One model held out (128 prompts x 4): dense and R-KV at the training budget, and one candidate tighter."""
    from sparserl.eval.evaluate import evaluate
    from sparserl.eval.loading import load_eval_model

    cfg, b = setting(), budget()
    tighter = max([c for c in read(RESULTS / "scoping.json")["candidates"] if c < b], default=None)
    loaded, task, out = load_eval_model(spec), task_of(cfg, "heldout"), {"model": spec}
    for i, bb in enumerate([x for x in (b, tighter) if x]):
        ev = evaluate(loaded.model, loaded.tokenizer, task, kv=eviction_kv(cfg, "rkv", bb), samples=4, limit=128,
                      max_new_tokens=cfg.rollout.max_new_tokens, seed=1234, dense=i == 0, details=True)  # fmt: skip
        for mode, key in (("dense", "dense"), ("sparse", f"rkv{bb}")):
            if mode in ev and (mode == "sparse" or i == 0):
                out[key] = {"per_prompt": [e[mode]["rewards"] for e in ev["examples"]],
                            "restate_share": R.restate_share([t for e in ev["examples"] for t in e[mode]["completions"]]),
                            **{k: ev[mode][k] for k in ("mean@4", "mean_length", "truncated_share") if k in ev[mode]}}  # fmt: skip
    write(RESULTS / "heldout" / f"{name}.json", out)


def evaluate_all(args) -> None:
    models = {"start": str(WARMSTART.relative_to(ROOT))}
    models.update(
        {
            p.stem: str((RUNS / p.stem).relative_to(ROOT))
            for p in sorted((RESULTS / "runs").glob("*-s*.jsonl"))
        }
    )
    for name, spec in models.items():
        if not (RESULTS / "heldout" / f"{name}.json").is_file():
            subprocess.run([sys.executable, __file__, "eval-one", name, spec], cwd=ROOT, check=True)
    print("commit:", COMMIT)


def main() -> int:
    from study_v3_report import report

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "stage", choices=["setup", "warmstart", "scope", "pilot", "run", "eval", "eval-one", "report"]
    )
    p.add_argument("args", nargs="*", help="eval-one: NAME SPEC")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=3e-4)
    p.add_argument(
        "--mismatch-prompts", type=int, default=16, help="scope: prompts whose samples are scored densely"
    )
    args = p.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    os.chdir(ROOT)  # the setting names its model relative to the repository root
    torch.set_num_threads(1)
    stages = {"setup": setup, "warmstart": warmstart, "scope": scope, "pilot": pilot, "run": run,
              "eval": evaluate_all, "report": lambda a: report()}  # fmt: skip
    if args.stage == "eval-one":
        eval_one(*args.args)
    else:
        stages[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
