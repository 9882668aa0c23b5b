"""What a re-prefilled sequence cannot reproduce of an uninterrupted one (APRIL's resumed samples, SPEC-RL's
continued drafts, tree children): the KL between the next-token distribution an uninterrupted run had at
position p and the one a run continued from the same p tokens has there, SmolLM2-135M.

    python benchmarks/reprefill_gap.py     # -> docs/results/reuse.json, section "reprefill_gap" (~0.1 CPU-hours)

An evicting cache's state at p depends on the path: decoding evicted as the sequence grew (every `interval`
steps, scored by the recent queries), while a re-prefill cuts prompt + prefix to the budget at once. A dense
cache holds the same keys and values either way (float noise aside). Each arm: 8 prompts of the default task x 2
samples, 64 new tokens, cut points at 25%, 50% and 75% of each completion; KL(uninterrupted || continued) at the
cut, full vocabulary, and whether the next token drawn (same stream) is the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _common import update_result

from sparserl.signals import stoppable

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "reuse.json"
COMMAND = "python benchmarks/reprefill_gap.py"
ARMS = {"dense": ["algo.preset=dense"], "rkv_budget_80": ["algo.preset=sparse-rl", "kv.method=rkv"]}


def decode(backend, requests, sampling) -> list:
    segments = []
    backend.run(requests, sampling, 0, 7, segments.append)
    return sorted(segments, key=lambda s: s.index)


def arm(name: str, overrides: list[str], out: Path) -> dict:
    import torch

    from sparserl.config import load_config
    from sparserl.engine.decoding import Request, Sampling
    from sparserl.rollout import LocalBackend, Recording
    from sparserl.trainer import Trainer

    cfg = load_config(None, [
        "rollout.prompts_per_step=8", "rollout.n=2", "trainer.threads=1", "trainer.eval_prompts=0",
        "logging.progress=false", "logging.tensorboard=false", "engine.compile=false",
        f"trainer.output_dir={out}", f"trainer.run_name=gap-{name}", *overrides,
    ])  # fmt: skip
    with Trainer(cfg) as trainer:
        backend = LocalBackend(trainer.engine, cfg.rollout, Recording(full_logprobs=True))
        sampling = Sampling(cfg.rollout.temperature)
        plans = trainer.source.plan(8, 0)
        whole = [Request(trainer.train_view.prompt_ids(p.row), key, p.seed, cfg.rollout.max_new_tokens)
                 for p in plans for key in p.keys]  # fmt: skip
        first = decode(backend, whole, sampling)
        cuts = [(i, int(len(s.tokens) * f)) for i, s in enumerate(first) for f in (0.25, 0.5, 0.75)]
        cuts = [(i, p) for i, p in cuts if 0 < p < len(first[i].tokens)]
        resumed = [Request(whole[i].prompt, whole[i].key, whole[i].seed, whole[i].max_new_tokens,
                           first[i].tokens[:p]) for i, p in cuts]  # fmt: skip
        second = decode(backend, resumed, sampling)
    kls, same = [], []
    for (i, p), seg in zip(cuts, second, strict=True):
        a, b = first[i].distributions.full_logprobs[p], seg.distributions.full_logprobs[0]
        kls.append(float(torch.sum(a.exp() * (a - b)).clamp(min=0)))
        same.append(seg.tokens[:1] == first[i].tokens[p : p + 1])
    return {
        "cuts": len(cuts), "kl_mean": statistics.fmean(kls), "kl_median": statistics.median(kls),
        "kl_max": max(kls), "next_token_same_frac": sum(same) / len(same),
        "kv": {k: getattr(cfg.kv, k) for k in ("method", "budget", "window", "interval")} if cfg.sparse else "dense",
    }  # fmt: skip


@stoppable("benchmarks/reprefill_gap.py", "the measurement; re-run it", exits=True)
def main() -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "reprefill_gap")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {name: arm(name, o, args.out) for name, o in ARMS.items()}
    update_result(OUT, "reprefill_gap", result, {})
    print(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
