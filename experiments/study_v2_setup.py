"""Study v2, the stages before training: the setting (experiments/study_v2.yaml), the warm start
that gives the base model a reward to learn from, and the scoping run that fixes the KV budget.

- `probe`: the dense reward of a model on a variant of the setting (config overrides).
- `warmstart`: a short LoRA SFT of SmolLM2-135M on worked answers, merged into runs/study_v2/warmstart, the
  study's starting model (experiments/study_v2.yaml points at it).
- `scope` (before any training, never re-tuned afterwards): the starting model on held-out prompts with the
  training sampler's settings: dense reward; per KV budget and eviction method, the sparse reward, the KV saved
  and the sampler/dense mismatch. The budget of the sparse arms comes from a rule fixed before the run.

Run through experiments/study_v2.py (`python experiments/study_v2.py scope`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from study import write_with_goals

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "study_v2.yaml"
RESULTS = ROOT / "docs" / "results" / "study_v2"
RUNS = ROOT / "runs" / "study_v2"
WARMSTART = RUNS / "warmstart"
WARMSTART_LORA = RUNS / "warmstart-lora"  # its LoRA alone (a few MB): the starting model, rebuilt elsewhere
BASE_MODEL = "smollm2-135m"
BUDGETS = (64, 96, 128, 192)
METHODS = ("rkv", "snapkv")
SAVED_MIN = 0.5  # the study's memory condition on a chosen budget
OFF_BY = 0.5  # a token whose sampler and dense log-probs differ by more than this counts as mismatched

# The design of the training stage (experiments/study_v2.py run)
STEPS = 40
BLOCK_TOPK = {"page_size": 16, "dense_layers": [0, 1]}
CAL_BIN = 64  # positions per bin of the alpha tail (calibration and training logs)
TAU, TAU_AGGRESSIVE = 0.86, 0.75
EVAL_PROMPTS, EVAL_SAMPLES = 128, 4
SPARROW = ["kv.method=block_topk", "kv.page_size=16", "kv.dense_layers=0,1", "trainer.log_acceptance=true",
           f"trainer.acceptance_bin={CAL_BIN}"]  # fmt: skip
# Arm -> overrides of experiments/study_v2.yaml; "{budget}" is the scoped eviction budget, "{schedule...}" the
# calibrated schedule files. Ordered so that the first goals' arms finish first.
ARMS: dict[str, list[str]] = {
    "dense": ["algo.preset=dense"],
    "sparse-rl-rkv": ["algo.preset=sparse-rl", "kv.method=rkv", "kv.budget={budget}"],
    "naive-sparse-rkv": ["algo.preset=naive-sparse", "kv.method=rkv", "kv.budget={budget}"],
    "sparrow-tau086": [*SPARROW, "algo.preset=tis", "kv.schedule={schedule_tau086}"],
    "sparrow-tau075": [*SPARROW, "algo.preset=naive-sparse", "kv.schedule={schedule_tau075}"],
    "sparse-rl-snapkv": ["algo.preset=sparse-rl", "kv.method=snapkv", "kv.budget={budget}"],
}
PARTS = RESULTS / "parts"
# The block_topk schedules a model is held out under besides dense and R-KV ("base": the starting model). No goal
# reads the eviction arms under block_topk, and each mode costs ~5 min of 2 cores.
HELDOUT_SCHEDULES = {
    "base": ("schedule_tau086",),
    "dense": ("schedule_tau086",),
    "sparrow-tau086": ("schedule_tau086",),
    "sparrow-tau075": ("schedule_tau086", "schedule_tau075"),
}

# The goals: every result file of the study carries them on top, measured or not
GOAL_TARGETS = {
    "naive_sparse_degrades": "final held-out gap to Sparse-RL > 2 standard errors, or naive collapses where "
    "Sparse-RL of the same seed does not",
    "sparse_rl_keeps_dense_gain": ">= 97% of the dense arm's held-out gain with >= 50% of the KV saved",
    "sparse_rl_model_under_sparse_inference": "Sparse-RL-trained model >= dense-trained one under sparse inference",
    "sparrow": "tau 0.86 within 2 standard errors of dense and faster per CPU second; tau 0.75 degrades",
}
COMMAND = "python experiments/study_v2.py run"


def unmeasured(reason: str) -> dict:
    """Every goal recorded as not met, with why it is not measured yet."""
    return {
        name: {"value": None, "target": target, "met": False, "command": COMMAND, "reason": reason}
        for name, target in GOAL_TARGETS.items()
    }


def write_result(out: dict, path: Path, goals: dict | None = None) -> None:
    """Write a result file with the study's goals on top (`goals`, else the ones already in `out`, else all
    recorded as not measured)."""
    write_with_goals(
        path, out, goals or out.get("goals") or unmeasured("not measured: no arm has trained yet")
    )


def mismatch(sampler: list[torch.Tensor], dense: list[torch.Tensor]) -> dict[str, float]:
    """Per-token log p_sampler - log p_dense over all tokens: its mean (k1 KL estimate of sampler vs dense), the
    k3 estimate exp(-d) - 1 + d, and the share of tokens with |d| > OFF_BY."""
    d = torch.cat([s - p for s, p in zip(sampler, dense, strict=True)]).double()
    return {
        "logp_gap_mean": float(d.mean()),
        "kl_k3": float((torch.exp(-d) - 1 + d).mean()),
        "frac_off": float((d.abs() > OFF_BY).double().mean()),
        "tokens": int(d.numel()),
    }


def eviction_kv(cfg, method: str, budget: int):
    """The setting's KV section with an eviction method and budget: what the eviction arms sample with."""
    return dataclasses.replace(cfg.kv, method=method, budget=budget)


def scope(args: argparse.Namespace, path: Path) -> dict:
    """Run (or continue: each finished configuration is saved at once) the scoping; returns its result."""
    from sparserl.config import load_config
    from sparserl.engine import RolloutEngine, score
    from sparserl.eval.evaluate import evaluate
    from sparserl.models import encode_prompt, load_model
    from sparserl.tasks import make_task

    cfg = load_config(CONFIG)
    model, tok = load_model(cfg.model.spec)
    task = make_task(cfg.task, "test")
    r = cfg.rollout
    prompt_len = [len(encode_prompt(tok, task[i].messages)) for i in range(args.prompts)]
    dense_positions = sum(prompt_len) / len(prompt_len) + r.max_new_tokens
    common = {"samples": args.samples, "limit": args.prompts, "max_new_tokens": r.max_new_tokens,
              "temperature": r.temperature, "top_p": r.top_p, "seed": 1234}  # fmt: skip
    t0 = time.perf_counter()
    out: dict = json.loads(path.read_text()) if path.is_file() else {}
    if out.get("setting", {}).get("prompts") not in (None, args.prompts):
        raise SystemExit(f"{path} holds a scoping of other settings; delete it to start again")
    out = out or {
        "setting": {"config": str(CONFIG.relative_to(ROOT)), "prompts": args.prompts, "samples": args.samples,
                    "prompt_tokens_mean": sum(prompt_len) / len(prompt_len), "prompt_tokens_max": max(prompt_len),
                    "max_new_tokens": r.max_new_tokens, "interval": cfg.kv.interval, "window": cfg.kv.window},
        "dense": evaluate(model, tok, task, **common)["dense"],
        "sparse": {},
        "complete": False,
    }  # fmt: skip
    write_result(out, path)
    k = args.samples
    print("dense", out["dense"][f"mean@{k}"], flush=True)
    prompts = [encode_prompt(tok, task[i].messages) for i in range(args.mismatch_prompts)]
    for method in METHODS:
        for budget in BUDGETS:
            if f"{method}@{budget}" in out["sparse"]:
                continue
            kv = eviction_kv(cfg, method, budget)
            sparse = evaluate(model, tok, task, kv=kv, dense=False, **common)["sparse"]
            rollouts = RolloutEngine(model, tok, kv).generate(
                prompts, n=args.samples, max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=99
            )
            dense_lp = score(
                model, [prompts[s.prompt_index] for s in rollouts], [s.completion_ids for s in rollouts]
            )
            bound = budget + cfg.kv.interval - 1
            row = {
                "reward": sparse[f"mean@{k}"],
                f"pass@{k}": sparse[f"pass@{k}"],
                "kv_saved_fraction": 1 - min(bound, dense_positions) / dense_positions,
                **mismatch([s.logprobs for s in rollouts], dense_lp),
            }
            out["sparse"][f"{method}@{budget}"] = row
            write_result(out, path)
            print(method, budget, {key: round(v, 4) for key, v in row.items()}, flush=True)
    rkv = [(b, out["sparse"][f"rkv@{b}"]) for b in BUDGETS]
    ok = [b for b, row in rkv if row["kv_saved_fraction"] >= SAVED_MIN and row["reward"] > 0]
    out["chosen_budget"] = min(ok) if ok else None
    out["rule"] = (f"the smallest scoped budget whose R-KV cache saves >= {SAVED_MIN:.0%} of the KV and whose base "
                   "sparse reward is above zero (fixed before the run)")  # fmt: skip
    out["seconds"] = out.get("seconds", 0.0) + time.perf_counter() - t0
    out["command"] = "python experiments/study_v2.py scope " + " ".join(sys.argv[2:])
    out["complete"] = True
    write_result(out, path)
    return out


def probe(args: argparse.Namespace) -> dict:
    """The base model's dense reward on a variant of the setting (config overrides), to find a setting it can
    learn from: appended to docs/results/study_v2/probes.json."""
    from sparserl.config import load_config
    from sparserl.eval.evaluate import evaluate
    from sparserl.models import load_model
    from sparserl.tasks import make_task

    cfg = load_config(CONFIG, args.overrides)
    model, tok = load_model(cfg.model.spec)
    r = cfg.rollout
    result = evaluate(model, tok, make_task(cfg.task, "test"), samples=args.samples, limit=args.prompts,
                      max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, seed=1234)  # fmt: skip
    k = args.samples
    row = {"model": cfg.model.spec, "overrides": args.overrides, "prompts": args.prompts, "samples": k,
           "prompt_tokens_mean": result["mean_prompt_tokens"], "dense_reward": result["dense"][f"mean@{k}"],
           "mean_length": result["dense"]["mean_length"],
           "command": "python experiments/study_v2.py " + " ".join(sys.argv[1:])}  # fmt: skip
    path = RESULTS / "probes.json"
    rows = json.loads(path.read_text())["probes"] if path.is_file() else []
    write_result({"probes": rows + [row]}, path)
    return row


def worked_answer(example) -> str:
    """The gold completion of a long_arithmetic problem, in the system prompt's worked style: the recalled
    values, the sum with the numbers, the boxed result."""
    facts, expression = example.meta["facts"], example.meta["expression"]
    recalled = " and ".join(f"{name} = {value}" for name, value in facts.items())
    numbers = " ".join(str(facts.get(item, item)) for item in expression.split())
    return f"{recalled}, so {expression} = {numbers} = {example.answer}. The result is \\boxed{{{example.answer}}}."


def weight_checksum(model: torch.nn.Module) -> str:
    """sha256 of a model's parameters (names and fp32 bytes): the same starting model on every machine."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def rebuild_warmstart() -> str:
    """The starting model from the base model and the warm start's saved LoRA, for a machine that was sent only
    the LoRA (the merged model is ~0.5 GB); returns its checksum, to compare with the warm start's."""
    from peft import PeftModel

    from sparserl.models import load_model

    model, tok = load_model(BASE_MODEL)
    return save_starting_model(PeftModel.from_pretrained(model, WARMSTART_LORA), tok)


def save_starting_model(peft, tok) -> str:
    """Merge `peft`'s LoRA into its base, save the result as the study's starting model; returns its checksum."""
    merged = peft.merge_and_unload().eval()
    merged.save_pretrained(WARMSTART)
    tok.save_pretrained(WARMSTART)
    return weight_checksum(merged)


def warmstart(args: argparse.Namespace) -> dict:
    """A short supervised warm start (the base model earns ~0 on the setting, so GRPO would see no signal):
    LoRA (the setting's rank) on `--sft-batch` train-split problems per step with their worked answers. Every
    `--sft-eval-every` steps its dense reward on the held-out probe prompts is measured, and it stops at the first
    that reaches `--sft-target` (a starting level RL can still improve on; 40 steps reach 0.95), or after
    `--sft-steps`. The LoRA is then merged and saved as the study's starting model."""
    from peft import LoraConfig, get_peft_model

    from sparserl.config import load_config
    from sparserl.engine import completion_logprobs
    from sparserl.eval.evaluate import evaluate
    from sparserl.models import encode_prompt, load_model, prepare_for_training
    from sparserl.tasks import make_task

    cfg = load_config(CONFIG, args.overrides)
    model, tok = load_model(BASE_MODEL)
    prepare_for_training(model)
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=cfg.model.lora_r, lora_alpha=cfg.model.lora_alpha,
                                            target_modules="all-linear"))  # fmt: skip
    params = [p for p in peft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.sft_lr)
    train, test, r, k = make_task(cfg.task, "train"), make_task(cfg.task, "test"), cfg.rollout, args.samples
    t0, losses, probes = time.perf_counter(), [], []
    for step in range(args.sft_steps):
        batch = [train[step * args.sft_batch + i] for i in range(args.sft_batch)]
        prompts = [encode_prompt(tok, ex.messages) for ex in batch]
        answers = [
            tok(worked_answer(ex), add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for ex in batch
        ]
        logp, mask = completion_logprobs(peft.get_base_model(), prompts, answers)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"sft step {step + 1}/{args.sft_steps}: loss {losses[-1]:.3f}", flush=True)
        if (step + 1) % args.sft_eval_every and step + 1 < args.sft_steps:
            continue
        with torch.no_grad():
            result = evaluate(peft.get_base_model(), tok, test, samples=k, limit=args.prompts, seed=1234,
                              max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)  # fmt: skip
        probes.append({"step": step + 1, "dense_reward": result["dense"][f"mean@{k}"],
                       "mean_length": result["dense"]["mean_length"]})  # fmt: skip
        print(probes[-1], flush=True)
        if probes[-1]["dense_reward"] >= args.sft_target:
            break
    WARMSTART.parent.mkdir(parents=True, exist_ok=True)
    peft.save_pretrained(WARMSTART_LORA)
    checksum = save_starting_model(peft, tok)
    row = {"stage": "warmstart", "overrides": args.overrides, "sft_steps": len(losses), "sft_batch": args.sft_batch,
           "sft_lr": args.sft_lr, "sft_target": args.sft_target, "losses": losses, "probes_during_sft": probes,
           "sft_seconds": time.perf_counter() - t0, "dense_reward": probes[-1]["dense_reward"],
           "mean_length": probes[-1]["mean_length"], "prompts": args.prompts, "samples": k,
           "saved": str(WARMSTART.relative_to(ROOT)), "weights_sha256": checksum, "command": "python experiments/study_v2.py " + " ".join(sys.argv[1:])}  # fmt: skip
    path = RESULTS / "probes.json"
    rows = json.loads(path.read_text())["probes"] if path.is_file() else []
    write_result({"probes": rows + [row]}, path)
    return row
