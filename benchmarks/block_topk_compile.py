"""block_topk's decode step under engine.compile (its page choice and attention eager islands between compiled
pieces) against the eager step: SmolLM2-135M, fp32, one thread, batch 16, `--window` decode steps at contexts
ending at `--context` (`sparserl.cost.probe.time_decode_steps`: a shared prefill of random ids, steps clocked
between step hooks), arms alternating `--repeats` times, median CPU seconds per step. Writes the
`block_topk_compile` section of docs/results/decode_step.json.

    python benchmarks/block_topk_compile.py        # ~3 CPU minutes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info  # noqa: E402

from sparserl.cost.probe import time_decode_steps  # noqa: E402
from sparserl.engine import KVConfig  # noqa: E402
from sparserl.models import load_model  # noqa: E402


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2048, help="context at the end of the timed window")
    ap.add_argument("--budget", type=int, default=512, help="block_topk positions read per step")
    ap.add_argument("--window", type=int, default=32, help="decode steps timed")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m")
    kv = KVConfig(method="block_topk", budget=args.budget, page_size=16, dense_layers=[0, 1])
    length = args.context - args.window
    cpu: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for arm in cpu:
            got = time_decode_steps(
                model, tok, [length], [kv], args.batch, args.window, 1, 1, arm == "compiled"
            )
            cpu[arm].append(got["block_topk", length].cpu[0])
    median = {arm: statistics.median(v) for arm, v in cpu.items()}
    section = {"command": command_line(), "settings": vars(args), "cpu_step_s": cpu, "median_cpu_step_s": median,
               "compiled_over_eager": median["compiled"] / median["eager"], "machine": machine_info()}  # fmt: skip
    path = RESULTS / "decode_step.json"
    results = json.loads(path.read_text())
    results["block_topk_compile"] = section
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(median), f"compiled / eager = {section['compiled_over_eager']:.2f}")
    return section


if __name__ == "__main__":
    main()
