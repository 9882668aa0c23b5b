"""The GPU decode goals of the speed round: the compiled engine's decode at batch 64 and 2k new tokens against
its memory-traffic floor, and against transformers' generate (benchmarks/rollout.py does the timing).

The floor: every decode step reads each weight once (the LM head included; a tied embedding counts once) and the
KV cache of every row once (keys and values of every layer up to the step's position), at the copy bandwidth
this device measures (a 1 GiB device-to-device copy: bytes read + bytes written over its median time). The
measured decode time over the floor summed over the generation's steps is the goal's ratio.

    python benchmarks/decode_floor.py --save-shape .gpu/smollm2-shape   # here: SmolLM2's config and tokenizer
    python benchmarks/decode_floor.py --device cuda --model .gpu/smollm2-shape --random-weights \
        --out docs/results/rollout_gpu_floor.json                       # on the GPU (scripts/gpu_checks.sh)
    python benchmarks/decode_floor.py --quick                           # a CPU smoke run, prints only
    python benchmarks/decode_floor.py --not-lent --out docs/results/rollout_gpu_floor.json
                                                                        # no GPU: both goals "not measured"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rollout  # noqa: E402
from _common import command_line, write_json  # noqa: E402

FLOOR_TARGET = 3.0  # measured decode over its memory-traffic floor, at most
SPEEDUP_TARGET = 5.0  # the engine's tokens/s over generate's, at least
FLOOR_GOAL = f"On a GPU: the compiled decode at batch 64 and 2k new tokens within {FLOOR_TARGET:g}x of its memory-traffic floor"
SPEEDUP_GOAL = f"On a GPU: the compiled engine >= {SPEEDUP_TARGET:g}x transformers' generate tokens/s at batch 64 and 2k new tokens"


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 7) -> float:
    """Bytes per second of a device-to-device copy (read + write), median of `repeats` after a warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def floor_seconds(model: torch.nn.Module, batch: int, prompt: int, new: int, bandwidth: float) -> dict:
    """The decode steps' bytes (weights once a step, each row's KV up to the step's position) over `bandwidth`."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights are one Parameter
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_position = (
        2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()
    )
    steps = range(prompt + 1, prompt + new)  # the first new token comes from the prefill
    kv = sum(batch * per_position * position for position in steps)
    total = weights * len(steps) + kv
    return {"weights_bytes": weights, "kv_bytes_per_position_per_row": per_position, "decode_steps": len(steps),
            "bytes_read": total, "floor_s": total / bandwidth}  # fmt: skip


def save_shape(folder: str) -> None:
    """SmolLM2-135M-Instruct's config and tokenizer (no weights) into `folder`, for --random-weights."""
    from sparserl.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"wrote {folder}")


def not_measured(out: str | None) -> dict:
    """Both goals recorded as not measured, for a session that had no GPU (`scripts/gpu_checks.sh` measures them
    where one is lent)."""
    status = "not measured: no GPU lent"
    goals = {goal: {"value": None, "target": target, "met": None, "status": status, "command": command_line()}
             for goal, target in ((FLOOR_GOAL, FLOOR_TARGET), (SPEEDUP_GOAL, SPEEDUP_TARGET))}  # fmt: skip
    result = {"goals": goals, "measure_with": "bash scripts/gpu_checks.sh (on a machine with a GPU)"}
    if out:
        print(f"wrote {write_json(out, result)}")
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random-weights", action="store_true", help="the config beside --model, random weights")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", default="256:2048", help="PROMPT:NEW")
    ap.add_argument("--quick", action="store_true", help="batch 4, 64:32, no JSON")
    ap.add_argument(
        "--save-shape", default=None, metavar="FOLDER", help="write SmolLM2's config and tokenizer"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--not-lent",
        action="store_true",
        help="record both goals as not measured (no GPU lent), time nothing",
    )
    args = ap.parse_args(argv)
    if args.save_shape:
        save_shape(args.save_shape)
        return {}
    if args.not_lent:
        return not_measured(args.out)
    if args.quick:
        args.batch, args.contexts = 4, "64:32"
    bandwidth = copy_bandwidth(args.device, (64 << 20) if args.quick else (1 << 30))
    timing = [
        "--device",
        args.device,
        "--model",
        args.model,
        "--batch",
        str(args.batch),
        "--contexts",
        args.contexts,
        "--repeats",
        "1",
        "--compile",
        *(["--random-weights"] if args.random_weights else []),
        "--out",
        str(Path(tempfile.mkdtemp()) / "timing.json"),
    ]  # fmt: skip  (its report is kept below)
    report = rollout.main(timing)
    (res,) = report["results"]
    model, _ = rollout.random_model(args.model) if args.random_weights else rollout.load_model(args.model)
    floor = floor_seconds(model, args.batch, res["prompt_tokens"], res["new_tokens"], bandwidth)
    ratio, speedup = res["sparserl"]["decode_s"] / floor["floor_s"], res["speedup_tokens_per_s"]
    out = {"command": command_line(), "device": args.device, "copy_bandwidth_bytes_per_s": bandwidth, **floor,
           "decode_s": res["sparserl"]["decode_s"], "decode_over_floor": ratio, "speedup_tokens_per_s": speedup,
           "timing": report}  # fmt: skip
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; decode {res['sparserl']['decode_s']:.2f} s, floor "
          f"{floor['floor_s']:.2f} s: {ratio:.2f}x; engine over generate {speedup:.2f}x")  # fmt: skip
    if args.device.startswith("cuda") and not args.quick:
        gpu = torch.cuda.get_device_name(args.device)
        out = {"goals": {
            FLOOR_GOAL: {"value": ratio, "target": FLOOR_TARGET, "met": ratio <= FLOOR_TARGET, "gpu": gpu,
                         "command": command_line()},
            SPEEDUP_GOAL: {"value": speedup, "target": SPEEDUP_TARGET, "met": speedup >= SPEEDUP_TARGET, "gpu": gpu,
                           "command": command_line()}}, **out}  # fmt: skip
    if args.out and not args.quick:
        print(f"wrote {write_json(args.out, out)}")
    return out


if __name__ == "__main__":
    main()
