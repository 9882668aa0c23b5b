"""Tree rollouts against independent chains at the same number of leaves, SmolLM2-135M: tokens generated per
leaf (a child keeps its parent's prefix and draws only from its fork point on).

    python benchmarks/tree_tokens.py      # -> docs/results/reuse.json, section "tree_tokens" (~0.1 CPU-hours)

TreeRL's script setting: M = 6 roots, L = 1 round, T = 2 fork points, N = 2 children: 6 + 6 x 2 x 2 = 30
leaves per prompt, against 30 independent samples per prompt; 4 prompts of the default task, 64 new tokens,
dense, temperature 1, seeds 0 and 1 (token counts, not timings).
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
COMMAND = "python benchmarks/tree_tokens.py"
ARMS = {
    "tree": ["rollout.n=6", "rollout.tree.enable=true", "rollout.tree.forks=2", "rollout.tree.children=2"],
    "chains": ["rollout.n=30"],
}


def arm(overrides: list[str], seed: int, out: Path) -> dict:
    from sparserl.config import load_config
    from sparserl.trainer import Trainer

    cfg = load_config(None, [
        "algo.preset=dense", "rollout.prompts_per_step=4", f"trainer.seed={seed}", "trainer.threads=1",
        "trainer.eval_prompts=0", "logging.progress=false", "logging.tensorboard=false", "engine.compile=false",
        f"trainer.output_dir={out}", f"trainer.run_name=tree-{seed}-{len(overrides)}", *overrides,
    ])  # fmt: skip
    with Trainer(cfg) as trainer:
        got = trainer.rollouts.collect_step(trainer.source, 4, 0, trainer.state.engine_seed)
    leaves = sum(len(g.samples) for g in got.groups)
    tokens = got.sampling["generated_tokens"]
    return {"seed": seed, "leaves": leaves, "generated_tokens": tokens, "tokens_per_leaf": tokens / leaves}


@stoppable("benchmarks/tree_tokens.py", "the measurement; re-run it", exits=True)
def main() -> dict:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "tree_tokens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {name: [arm(o, seed, args.out) for seed in (0, 1)] for name, o in ARMS.items()}
    ratios = [
        t["tokens_per_leaf"] / c["tokens_per_leaf"] for t, c in zip(runs["tree"], runs["chains"], strict=True)
    ]
    value = statistics.fmean(ratios)
    goals = {
        "Trees: <= 0.8x the generated tokens of independent chains for the same number of leaves": {
            "value": value, "target": 0.8, "met": value <= 0.8, "command": COMMAND, "per_seed": ratios,
        },
    }  # fmt: skip
    update_result(OUT, "tree_tokens", {"runs": runs, "setting": ARMS}, goals)
    print(json.dumps({"goals": goals, "runs": runs}, indent=1))
    return runs


if __name__ == "__main__":
    main()
    sys.exit(0)
