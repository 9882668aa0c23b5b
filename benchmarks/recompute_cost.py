"""What the elementwise recompute (`optim.recompute_modules` 'layernorm', 'mlp_act') costs the update: one default
rollout, then the learner's update on that batch, alternating the recompute off and on, from the same weights,
optimizer and schedule each time, at one thread; CPU seconds, medians and their ratio. The loss must come out
the same in both arms (the recompute is bit for bit).

    python benchmarks/recompute_cost.py                    # both names, 3 pairs (~5 min)
    python benchmarks/recompute_cost.py --names mlp_act    # the product only

Writes docs/results/memory.json section `recompute_cost` (or `recompute_cost_<names>`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, OneBatchUpdates, machine_info, update_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--names", default="layernorm,mlp_act", help="the optim.recompute_modules names measured")
    p.add_argument("--pairs", type=int, default=3)
    args = p.parse_args()
    from sparserl.engine.decoder import causal_lm

    with OneBatchUpdates([f"optim.recompute_modules=[{args.names}]"]) as updates:
        layers = causal_lm(updates.trainer.policy.module).model.layers
        mods = [m for layer in layers for m in (layer, layer.input_layernorm, layer.post_attention_layernorm)]
        bound = [(m, vars(m)["forward"]) for m in mods if "forward" in vars(m)]
        runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        for _ in range(args.pairs):
            for arm in runs:
                for module, forward in bound:  # off: the class forwards, as without the setting
                    if arm == "off":
                        vars(module).pop("forward", None)
                    else:
                        module.forward = forward
                t0, c0 = time.perf_counter(), time.process_time()
                metrics = updates.update()
                runs[arm].append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                                  "pg_loss": metrics.get("actor/pg_loss")})  # fmt: skip
                print(arm, runs[arm][-1], flush=True)
    median = {arm: statistics.median(r["cpu_s"] for r in rs) for arm, rs in runs.items()}
    same = len({r["pg_loss"] for rs in runs.values() for r in rs}) == 1
    payload = {"names": args.names, "runs": runs, "median_cpu_s": median, "on_over_off": median["on"] / median["off"],
               "same_loss": same, "machine": machine_info(),
               "command": f"python benchmarks/recompute_cost.py --names {args.names}"}  # fmt: skip
    section = "recompute_cost" + (
        "" if args.names == "layernorm,mlp_act" else "_" + args.names.replace(",", "_")
    )
    update_result(RESULTS / "memory.json", section, payload, {})
    print(
        f"update CPU s: off {median['off']:.1f}, on {median['on']:.1f} ({payload['on_over_off']:.3f}x); "
        f"same loss: {same}"
    )


if __name__ == "__main__":
    main()
