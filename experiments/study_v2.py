"""Study v2 (issue 19): do the Sparse-RL and Sparrow claims hold where sparsity bites? Long-context recall
(long_arithmetic, experiments/study_v2.yaml), both sparse families, several seeds.

Stage 1, `scope` (done first, before any training, and never re-tuned afterwards): the base model on held-out
prompts, with the training sampler's settings (temperature 1, 128 new tokens): dense reward; per KV budget and
eviction method, the sparse reward, the KV saved, and the sampler/dense mismatch of the sparse samples (per-token
log p_sampler - log p_dense: mean, k3 KL estimate, the share of tokens off by more than 0.5). The budget of the
sparse arms is then chosen by a rule fixed before the run: the smallest scoped budget that saves >= 50% of the
KV (against prompt + 128 dense positions) while the base sparse sampler's reward stays above zero (R-KV).

    python experiments/study_v2.py scope      # ~15 min on 2 cores; cached in docs/results/study_v2/scoping.json

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


def scope(args: argparse.Namespace) -> dict:
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
    out: dict = {
        "setting": {"config": str(CONFIG.relative_to(ROOT)), "prompts": args.prompts, "samples": args.samples,
                    "prompt_tokens_mean": sum(prompt_len) / len(prompt_len), "prompt_tokens_max": max(prompt_len),
                    "max_new_tokens": r.max_new_tokens, "interval": cfg.kv.interval, "window": cfg.kv.window},
        "dense": evaluate(model, tok, task, **common)["dense"],
        "sparse": {},
    }  # fmt: skip
    print("dense", out["dense"]["mean@k"], flush=True)
    prompts = [encode_prompt(tok, task[i].messages) for i in range(args.mismatch_prompts)]
    for method in METHODS:
        for budget in BUDGETS:
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
                "reward": sparse["mean@k"],
                "pass@k": sparse["pass@k"],
                "kv_saved_fraction": 1 - min(bound, dense_positions) / dense_positions,
                **mismatch([s.logprobs for s in rollouts], dense_lp),
            }
            out["sparse"][f"{method}@{budget}"] = row
            print(method, budget, {k: round(v, 4) for k, v in row.items()}, flush=True)
    rkv = [(b, out["sparse"][f"rkv@{b}"]) for b in BUDGETS]
    ok = [b for b, row in rkv if row["kv_saved_fraction"] >= SAVED_MIN and row["reward"] > 0]
    out["chosen_budget"] = min(ok) if ok else None
    out["rule"] = (f"the smallest scoped budget whose R-KV cache saves >= {SAVED_MIN:.0%} of the KV and whose base "
                   "sparse reward is above zero (fixed before the run)")  # fmt: skip
    out["seconds"] = time.perf_counter() - t0
    out["command"] = "python experiments/study_v2.py scope " + " ".join(sys.argv[2:])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["scope"])
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts for rewards")
    p.add_argument("--samples", type=int, default=2, help="samples per prompt")
    p.add_argument("--mismatch-prompts", type=int, default=8, help="prompts whose samples are scored densely")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "scoping.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = args.out
    if path.is_file():
        print(f"{path} exists (the scoping is done once; delete it to redo)")
        return 0
    with torch.no_grad():
        result = scope(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print("chosen budget:", result["chosen_budget"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
