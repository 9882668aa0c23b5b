"""The sampler/learner log-prob gap of dense rollouts at float32, bfloat16 and float16 (SmolLM2-135M, CPU).

For each precision a policy is built as training builds it (`Policy` over `model.dtype`; LoRA, the default, so
its frozen base is kept in that dtype), the engine draws dense rollouts in it (4 arithmetic prompts x 4 samples
x 64 new tokens, EOS ignored, temperature 1), and the learner's teacher-forced pass scores them under the
policy's autocast, as pi_old is scored. Per token d = log p_learner - log p_sampler; reported: k3 = mean of
exp(d) - 1 - d (the k3 estimate of KL(sampler || learner), what `rollout_corr/k3_kl` logs), mean |d|, max |d|.
float32 is the reference: its gap is rounding alone, and every precision's learner log-probs are also compared
with the float32 learner's on the same tokens (how far the precision moves the policy itself). The two half
precisions run again with `model.fp32_lm_head=true`. Numerics are the CPU's; a GPU rounds differently.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/precision.py   # docs/results/precision.json, ~5 CPU minutes
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import RESULTS, machine_info

from sparserl.config import ModelConfig
from sparserl.engine import RolloutEngine, score
from sparserl.models import encode_prompt
from sparserl.trainer.policy import Policy

GOAL = "fp16 sampler/learner gap measured against bf16 and fp32"
ARMS = [("float32", False), ("bfloat16", False), ("float16", False), ("bfloat16", True), ("float16", True)]
QUESTIONS = ["What is 17 + 25?", "What is 3 + 9?", "What is 128 + 64?", "What is 7 + 58?"]


def arm_name(dtype: str, fp32_head: bool) -> str:
    return f"{dtype}+fp32_lm_head" if fp32_head else dtype


def learner_logprobs(policy: Policy, prompts: list[list[int]], samples: list) -> list[torch.Tensor]:
    """The learner's teacher-forced log-probs of each sample, under the policy's autocast."""
    with torch.no_grad(), policy.autocast():
        return score(
            policy.module, [prompts[s.prompt_index] for s in samples], [s.completion_ids for s in samples]
        )


def gap_stats(d: torch.Tensor) -> dict[str, float]:
    """k3, mean and max |d| over the tokens of d = log p_learner - log p_sampler (float64)."""
    d = d.double()
    return {
        "k3": float((d.exp() - 1 - d).mean()),
        "mean_abs_log_ratio": float(d.abs().mean()),
        "max_abs_log_ratio": float(d.abs().max()),
    }


def run_arm(
    spec: str, dtype: str, fp32_head: bool, prompts, tokens: int, samples: int, reference: Policy | None
) -> dict:
    """One precision's rollouts, their gap to its learner, and its learner's gap to float32's (`reference`;
    None: this is float32)."""
    start = time.process_time()
    cfg = ModelConfig(spec=spec, dtype=dtype, fp32_lm_head=fp32_head, device="cpu")
    policy = Policy(cfg, seed=0)
    engine = RolloutEngine(policy.module, policy.tokenizer, dtype=policy.compute_dtype)
    engine.eos_ids = set()  # every sample runs its whole length
    out = engine.generate(prompts, n=samples, max_new_tokens=tokens, seed=0)
    sampler = torch.cat([s.logprobs.float() for s in out])
    learner = torch.cat(learner_logprobs(policy, prompts, out))
    row = {**gap_stats(learner - sampler), "tokens": int(sampler.numel())}
    ref = policy if reference is None else reference  # float32's own learner is the reference
    fp32_learner = torch.cat(learner_logprobs(ref, prompts, out)) if reference is not None else learner
    row["learner_vs_float32_learner"] = gap_stats(learner - fp32_learner)
    row["cpu_s"] = round(time.process_time() - start, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--out", type=Path, default=RESULTS / "precision.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    reference = Policy(ModelConfig(spec=a.model, dtype="float32", device="cpu"), seed=0)
    prompts = [encode_prompt(reference.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    gaps = {}
    for dtype, fp32_head in ARMS:
        ref = None if dtype == "float32" else reference
        gaps[arm_name(dtype, fp32_head)] = row = run_arm(
            a.model, dtype, fp32_head, prompts, a.tokens, a.samples, ref
        )
        print(arm_name(dtype, fp32_head), json.dumps(row), flush=True)
    base = gaps["float32"]["mean_abs_log_ratio"]
    for row in gaps.values():
        row["mean_abs_log_ratio_vs_float32"] = row["mean_abs_log_ratio"] / base
    result = {
        "goals": {
            GOAL: {
                "value": gaps["float16"]["mean_abs_log_ratio"],
                "target": None,
                "met": True,
                "unit": "mean |log p_learner - log p_sampler| per token, float16 (no target: the figure is the point)",
                "command": "python benchmarks/precision.py",
            }
        },
        "gaps": gaps,
        "settings": {
            "model": f"{a.model} (model.lora=true, the default: the frozen base in the dtype)",
            "prompts": len(prompts),
            "samples_per_prompt": a.samples,
            "tokens": a.tokens,
            "eos": "ignored",
            "temperature": 1.0,
            "kv": "dense",
            "device": "cpu",
            "threads": 1,
        },
        "machine": machine_info(),
    }
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["goals"], indent=1))


if __name__ == "__main__":
    main()
