"""What the weights version saves: the packed projection copy (engine/weights.py) of the default config's policy
(SmolLM2-135M, LoRA r16 merged, float32, one thread) built at every `generate` (untracked model, as before)
against reused while the version stands (tracked: one build, then a key check per call).

    python benchmarks/repack.py              # 5 repeats, arms alternating -> docs/results/rl_step.json "repack"

Each repeat times, in CPU seconds, `Decoder.prepare()` + `release()` on an untracked model (a full build) and
on a tracked one whose copy is cached (the key check alone). The seconds saved per training step then follow
from how many `generate` calls share a version in a run: `benchmarks/memory.py` counts the builds and prepares
of a real `sparserl train` run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-record", action="store_true", help="print only")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from sparserl.config import load_config
    from sparserl.engine.decoder import Decoder
    from sparserl.engine.weights import WEIGHTS_VERSION_ATTR, bump_weights_version
    from sparserl.trainer.policy import Policy

    cfg = load_config(None, [])
    policy = Policy(cfg.model, seed=0)  # tracked (the trainer's policy)
    lm = policy.module
    decoder = Decoder(lm, policy.compute_dtype)

    def prepare_cpu() -> float:
        t0 = time.process_time()
        decoder.prepare()
        decoder.release()
        return time.process_time() - t0

    untracked, cached, after_bump = [], [], []
    for _ in range(args.repeats):
        version = getattr(lm, WEIGHTS_VERSION_ATTR)
        delattr(lm, WEIGHTS_VERSION_ATTR)  # as an external user's model: no promise, a build per call
        untracked.append(prepare_cpu())
        setattr(lm, WEIGHTS_VERSION_ATTR, version)
        bump_weights_version(lm)
        after_bump.append(prepare_cpu())  # the version moved: one build
        cached.append(prepare_cpu())  # same version: the cached copy
    result = {
        "command": command_line(),
        "model": f"{cfg.model.spec}, lora r{cfg.model.lora_r} (merged into the copy), {cfg.model.dtype}",
        "threads": args.threads,
        "repeats": args.repeats,
        "prepare_cpu_s_untracked": untracked,
        "prepare_cpu_s_after_bump": after_bump,
        "prepare_cpu_s_cached": cached,
        "median_untracked_s": statistics.median(untracked),
        "median_after_bump_s": statistics.median(after_bump),
        "median_cached_s": statistics.median(cached),
        "saved_per_reused_call_s": statistics.median(untracked) - statistics.median(cached),
        "machine": machine_info(),
    }
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("median", "saved"))}, indent=1))
    if not args.no_record:
        path = RESULTS / "rl_step.json"
        data = json.loads(path.read_text())
        data["repack"] = {**data.get("repack", {}), "prepare": result}
        path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
