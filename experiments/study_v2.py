"""Study v2 (issue 19): do the Sparse-RL and Sparrow claims hold where sparsity bites? Long-context recall
(long_arithmetic, experiments/study_v2.yaml), both sparse families, several seeds.

Stage 1, `scope` (done first, before any training, and never re-tuned afterwards): the base model on held-out
prompts, with the training sampler's settings (temperature 1, 128 new tokens): dense reward; per KV budget and
eviction method, the sparse reward, the KV saved, and the sampler/dense mismatch of the sparse samples (per-token
log p_sampler - log p_dense: mean, k3 KL estimate, the share of tokens off by more than 0.5). The budget of the
sparse arms is then chosen by a rule fixed before the run: the smallest scoped budget that saves >= 50% of the
KV (against prompt + 128 dense positions) while the base sparse sampler's reward stays above zero (R-KV).

    python experiments/study_v2.py probe task.num_distractors=10   # the base's dense reward on a variant
    python experiments/study_v2.py scope      # ~30 min on 2 cores -> docs/results/study_v2/scoping.json;
                                              # re-run after a kill: finished configurations are kept

The training arms (dense, naive and Sparse-RL R-KV, Sparse-RL SnapKV, Sparrow at tau 0.86 and 0.75; 3 seeds,
>= 40 steps) are the next stage; this driver does not run them yet.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "study_v2.yaml"
RESULTS = ROOT / "docs" / "results" / "study_v2"
BUDGETS = (64, 96, 128, 192)
METHODS = ("rkv", "snapkv")
SAVED_MIN = 0.5  # the memory condition on a chosen budget
OFF_BY = 0.5  # a token whose sampler and dense log-probs differ by more than this counts as mismatched


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


def scope(args: argparse.Namespace, path: Path) -> dict:
    """Run (or continue: each finished configuration is saved at once) the scoping; returns its result."""
    from sparserl.config import load_config
    from sparserl.engine import KVConfig, RolloutEngine, score
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
    save(out, path)
    k = args.samples
    print("dense", out["dense"][f"mean@{k}"], flush=True)
    prompts = [encode_prompt(tok, task[i].messages) for i in range(args.mismatch_prompts)]
    for method in METHODS:
        for budget in BUDGETS:
            if f"{method}@{budget}" in out["sparse"]:
                continue
            kv = KVConfig(method=method, budget=budget, interval=cfg.kv.interval, window=cfg.kv.window)
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
            save(out, path)
            print(method, budget, {key: round(v, 4) for key, v in row.items()}, flush=True)
    rkv = [(b, out["sparse"][f"rkv@{b}"]) for b in BUDGETS]
    ok = [b for b, row in rkv if row["kv_saved_fraction"] >= SAVED_MIN and row["reward"] > 0]
    out["chosen_budget"] = min(ok) if ok else None
    out["rule"] = (f"the smallest scoped budget whose R-KV cache saves >= {SAVED_MIN:.0%} of the KV and whose base "
                   "sparse reward is above zero (fixed before the run)")  # fmt: skip
    out["seconds"] = out.get("seconds", 0.0) + time.perf_counter() - t0
    out["command"] = "python experiments/study_v2.py scope " + " ".join(sys.argv[2:])
    out["complete"] = True
    save(out, path)
    return out


# The goals, none measured until the arms have trained: every result file of the study carries them
NOT_RUN = "not measured: only the scoping stage has run (no arm has trained)"
GOALS = {
    "naive_sparse_degrades": "final held-out gap to Sparse-RL > 2 standard errors, or a visible collapse",
    "sparse_rl_keeps_dense_gain": ">= 97% of the dense arm's held-out gain with >= 50% of the KV saved",
    "sparse_rl_model_under_sparse_inference": "Sparse-RL-trained model >= dense-trained one under sparse inference",
    "sparrow": "tau 0.86 within 2 standard errors of dense and faster per CPU second; tau 0.75 degrades",
}


def save(out: dict, path: Path) -> None:
    """Write a result file with the study's goals on top (all recorded as not met until measured)."""
    goals = {
        name: {
            "value": None,
            "target": target,
            "met": False,
            "command": "python experiments/study_v2.py",
            "reason": NOT_RUN,
        }
        for name, target in GOALS.items()
    }
    out = {"goals": goals, **{k: v for k, v in out.items() if k != "goals"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


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
    row = {"overrides": args.overrides, "prompts": args.prompts, "samples": k,
           "prompt_tokens_mean": result["mean_prompt_tokens"], "dense_reward": result["dense"][f"mean@{k}"],
           "mean_length": result["dense"]["mean_length"],
           "command": "python experiments/study_v2.py " + " ".join(sys.argv[1:])}  # fmt: skip
    path = RESULTS / "probes.json"
    rows = json.loads(path.read_text())["probes"] if path.is_file() else []
    save({"probes": rows + [row]}, path)
    return row


WARMSTART = ROOT / "runs" / "study_v2" / "warmstart"


def worked_answer(example) -> str:
    """The gold completion of a long_arithmetic problem, in the system prompt's worked style: the recalled
    values, the sum with the numbers, the boxed result."""
    facts, expression = example.meta["facts"], example.meta["expression"]
    recalled = " and ".join(f"{name} = {value}" for name, value in facts.items())
    numbers = " ".join(str(facts.get(item, item)) for item in expression.split())
    return f"{recalled}, so {expression} = {numbers} = {example.answer}. The result is \\boxed{{{example.answer}}}."


def warmstart(args: argparse.Namespace) -> dict:
    """A short supervised warm start (the base model earns ~0 on the setting, so GRPO would see no signal):
    LoRA (the setting's rank) on `--sft-steps` x `--sft-batch` train-split problems with their worked answers,
    merged and saved as the study's starting model; then its dense reward on the held-out probe prompts."""
    from peft import LoraConfig, get_peft_model

    from sparserl.config import load_config
    from sparserl.engine import completion_logprobs
    from sparserl.eval.evaluate import evaluate
    from sparserl.models import encode_prompt, load_model, prepare_for_training
    from sparserl.tasks import make_task

    cfg = load_config(CONFIG, args.overrides)
    model, tok = load_model(cfg.model.spec)
    prepare_for_training(model)
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=cfg.model.lora_r, lora_alpha=cfg.model.lora_alpha,
                                            target_modules="all-linear"))  # fmt: skip
    params = [p for p in peft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.sft_lr)
    train = make_task(cfg.task, "train")
    t0, losses = time.perf_counter(), []
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
        losses.append(float(loss))
        print(f"sft step {step + 1}/{args.sft_steps}: loss {losses[-1]:.3f}", flush=True)
    merged = peft.merge_and_unload().eval()
    WARMSTART.parent.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(WARMSTART)
    tok.save_pretrained(WARMSTART)
    r = cfg.rollout
    with torch.no_grad():
        result = evaluate(merged, tok, make_task(cfg.task, "test"), samples=args.samples, limit=args.prompts,
                          max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, seed=1234)  # fmt: skip
    k = args.samples
    row = {"stage": "warmstart", "overrides": args.overrides, "sft_steps": args.sft_steps, "sft_batch": args.sft_batch,
           "sft_lr": args.sft_lr, "losses": losses, "sft_seconds": time.perf_counter() - t0,
           "dense_reward": result["dense"][f"mean@{k}"], "mean_length": result["dense"]["mean_length"],
           "prompts": args.prompts, "samples": k, "saved": str(WARMSTART.relative_to(ROOT)),
           "command": "python experiments/study_v2.py " + " ".join(sys.argv[1:])}  # fmt: skip
    path = RESULTS / "probes.json"
    rows = json.loads(path.read_text())["probes"] if path.is_file() else []
    save({"probes": rows + [row]}, path)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["scope", "probe", "warmstart"])
    p.add_argument("overrides", nargs="*", help="probe: config overrides of the setting (key=value)")
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts for rewards")
    p.add_argument("--samples", type=int, default=2, help="samples per prompt")
    p.add_argument("--mismatch-prompts", type=int, default=8, help="prompts whose samples are scored densely")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=40, help="warmstart: optimizer steps")
    p.add_argument("--sft-batch", type=int, default=8, help="warmstart: problems per step")
    p.add_argument("--sft-lr", type=float, default=3e-4, help="warmstart: AdamW learning rate of the LoRA")
    p.add_argument("--out", type=Path, default=RESULTS / "scoping.json")
    args = p.parse_intermixed_args()  # options may come before or after the overrides
    torch.set_num_threads(args.threads)
    if args.stage == "warmstart":
        print(warmstart(args))
        return 0
    if args.stage == "probe":
        with torch.no_grad():
            print(probe(args))
        return 0
    path = args.out
    if path.is_file() and json.loads(path.read_text()).get("complete"):
        print(f"{path} is complete (the scoping is done once; delete it to redo)")
        return 0
    with torch.no_grad():
        result = scope(args, path)
    print("chosen budget:", result["chosen_budget"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
