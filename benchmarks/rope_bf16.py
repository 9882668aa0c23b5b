"""RoPE in the bfloat16 sampler: rotating q and k in float32 (then rounding) against rotating in bfloat16, by
the gap between the sampler's log-probs and the bfloat16-autocast scorer's on the same tokens (SmolLM2-135M).

Per seed, both arms sample the same prompts (4 arithmetic prompts x 4 samples x `--tokens` new tokens, EOS
ignored) and the scorer re-scores each arm's own samples; arms alternate within a seed. The bfloat16 arm is the
engine as it is (`Decoder.rope` hands its tables over in the compute dtype); the float32 arm hands them over
in float32, which makes `Decoder.qkv` rotate in float32 and round after.

    python benchmarks/rope_bf16.py                       # docs/results/rope_bf16.json, ~5 CPU minutes
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import RESULTS, machine_info

from sparserl.engine import RolloutEngine, score
from sparserl.engine.decoder import Decoder
from sparserl.models import encode_prompt, load_model

GOAL = "the float32 rotation narrows the mean sampler/scorer gap of the bfloat16 sampler on SmolLM2"


@contextmanager
def float32_rotation():
    """`Decoder.rope` hands over the model's float32 tables: the rotation then runs in float32."""
    original = Decoder.rope
    Decoder.rope = lambda self, hidden, positions: self.model.model.rotary_emb(hidden, positions)
    try:
        yield
    finally:
        Decoder.rope = original


def gap(model, tok, prompts: list[list[int]], tokens: int, seed: int) -> float:
    """Mean |log p_sampler - log p_scorer| over every sampled token."""
    engine = RolloutEngine(model, tok, dtype=torch.bfloat16)
    engine.eos_ids = set()
    out = engine.generate(prompts, n=4, max_new_tokens=tokens, seed=seed)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        scored = score(model, [prompts[s.prompt_index] for s in out], [s.completion_ids for s in out])
    return float(torch.cat([(s.logprobs - x.float()).abs() for s, x in zip(out, scored, strict=True)]).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "rope_bf16.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_model("smollm2-135m")
    questions = [f"What is {x} + {y}?" for x, y in ((17, 25), (3, 9), (128, 64), (7, 58))]
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}]) for q in questions]
    rows = []
    for seed in range(a.seeds):
        arms = ("float32", "bfloat16") if seed % 2 == 0 else ("bfloat16", "float32")
        row = {"seed": seed}
        for arm in arms:
            if arm == "float32":
                with float32_rotation():
                    row[arm] = gap(model, tok, prompts, a.tokens, seed)
            else:
                row[arm] = gap(model, tok, prompts, a.tokens, seed)
        rows.append(row)
        print(row, flush=True)
    diffs = [r["bfloat16"] - r["float32"] for r in rows]
    narrower = sum(d > 0 for d in diffs)
    result = {
        "goals": {
            GOAL: {
                "value": statistics.median(r["float32"] / r["bfloat16"] for r in rows),
                "target": 1.0,
                "met": narrower == len(rows),
                "unit": "median ratio of mean gaps, float32 rotation / bfloat16 rotation (met: narrower on every seed)",
                "command": "python benchmarks/rope_bf16.py",
            }
        },
        "decision": "float32 rotation kept"
        if narrower == len(rows)
        else "bfloat16 rotation kept (Decoder.rope in the compute dtype): the float32 one did not narrow the gap on every seed",
        "per_seed": rows,
        "settings": {
            "prompts": len(prompts),
            "samples_per_prompt": 4,
            "tokens": a.tokens,
            "model": "smollm2-135m",
        },
        "machine": machine_info(),
    }
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["goals"], indent=1))


if __name__ == "__main__":
    main()
