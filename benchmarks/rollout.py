"""Rollout throughput: sparserl's RolloutEngine vs transformers' `model.generate`, side by side, same model.

Both get the same model object (fp32), the same batch of distinct prompts of exactly `prompt` tokens each (so no
padding on either side), the same number of new tokens with EOS ignored (HF: `min_new_tokens`; ours:
`engine.eos_ids = set()`), and the same sampling (temperature 1, top-p 1, top-k off). Model load is excluded.
Prefill is timed up to the first sampling step (ours: the engine's own `prefill_s`; HF: a logits processor takes
the time at its first call, which comes right after the prompt forward) and decode is the rest. Peak memory is
the process RSS high-water mark during the call (reset before it), reported also as the growth over the RSS before
the call. Runs alternate (ours, HF, ours, HF, ...) so that a busy machine slows both alike; medians are reported.

    python benchmarks/rollout.py                # batch 16, contexts 512+512 and 1024+1024, writes docs/results
    python benchmarks/rollout.py --quick        # a smoke run in about a minute, prints only
    python benchmarks/rollout.py --group 8 --contexts 512:128 --out /tmp/group.json   # GRPO groups of 8
    python benchmarks/rollout.py --device cuda --batch 64 --contexts 256:2048 --repeats 3 \
        --out docs/results/rollout_gpu.json         # the GPU rollout goal; on a GPU machine

On a GPU the timings end with a synchronize and the peak is also the GPU's allocated high-water mark.
`--random-weights` builds the model from the config beside `--model` (a Hugging Face folder) with random weights:
with EOS ignored and no top-k/top-p, tokens/s depends on the shapes alone, so a machine that holds the config
and tokenizer but not the weights measures the same thing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    GPU_GOAL,
    GPU_GOAL_TARGET,
    RESULTS,
    command_line,
    machine_info,
    measure,
    median_of,
    mib,
    peak_is_resettable,
    print_table,
    write_json,
)

from sparserl.engine import RolloutEngine  # noqa: E402
from sparserl.grouped_sdpa import GROUPED_SDPA  # noqa: E402
from sparserl.models import load_model  # noqa: E402
from sparserl.signals import stoppable  # noqa: E402

TEXT = (
    "The history of numbers begins with counting. Shepherds matched pebbles to sheep, merchants cut notches "
    "into sticks, and scribes pressed wedges into clay. Over centuries these tallies became systems of numerals, "
    "and the idea of place value let a few symbols write any quantity. Zero arrived late: first as a gap, then "
    "as a placeholder, and finally as a number in its own right, with rules for adding and multiplying it. "
)


def make_prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `length` tokens (a numbered question over a rotated text)."""
    words = (TEXT * (length // 40 + 2)).split()
    prompts = []
    for row in range(batch):
        rotated = words[row * 7 % len(words) :] + words[: row * 7 % len(words)]
        text = f"Question {row}: summarise the following passage.\n" + " ".join(rotated)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) < length:
            ids = ids + ids
        prompts.append(ids[:length])
    return prompts


def run_ours(
    engine: RolloutEngine, prompts: list[list[int]], new: int, seed: int, group: int = 1
) -> dict[str, float]:
    """One engine call, `group` samples per prompt; EOS is off on the engine (`eos_ids = set()`)."""
    with measure() as m:
        out = engine.generate(
            prompts, n=group, max_new_tokens=new, temperature=1.0, top_p=1.0, top_k=0, seed=seed
        )
    generated = sum(len(s.completion_ids) for s in out)
    assert generated == new * len(prompts) * group, "EOS must be disabled for a fair comparison"
    prefill = out.stats["prefill_s"]
    return metrics(m, prefill, m["seconds"] - prefill, prompts, group, generated)


class FirstCall(LogitsProcessor):
    """Records when generation first asks for next-token scores: the end of the prompt forward."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            self.t = time.perf_counter()
        return scores


def run_hf(
    model, tokenizer, prompts: list[list[int]], new: int, seed: int, group: int = 1
) -> dict[str, float]:
    """One `model.generate` call: sampling at temperature 1, no top-k/top-p, EOS suppressed by min_new_tokens.

    `group` samples per prompt come from `num_return_sequences` (transformers repeats the prompt rows).
    """
    ids = torch.tensor(prompts, device=model.device)
    first = FirstCall()
    torch.manual_seed(seed)
    with measure() as m, torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=tokenizer.pad_token_id,
            num_return_sequences=group,
            logits_processor=LogitsProcessorList([first]),
        )
    generated = int((out.shape[1] - ids.shape[1]) * out.shape[0])
    assert generated == new * len(prompts) * group
    prefill = first.t - t0
    return metrics(m, prefill, m["seconds"] - prefill, prompts, group, generated)


def metrics(
    m: dict[str, float], prefill_s: float, decode_s: float, prompts, group: int, generated: int
) -> dict[str, float]:
    rows = len(prompts) * group
    gpu = {"peak_gpu_mib": mib(m["peak_gpu_bytes"])} if "peak_gpu_bytes" in m else {}
    return gpu | {
        "total_s": m["seconds"],
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tokens_per_s": generated / m["seconds"],
        # prompt tokens served: each of a prompt's `group` sequences counts its prompt
        "prefill_tokens_per_s": group * sum(map(len, prompts)) / prefill_s,
        # the first token of every row comes with the prefill; the decode loop makes the rest
        "decode_tokens_per_s": (generated - rows) / decode_s if decode_s > 0 else 0.0,
        "decode_step_s": decode_s / max(generated // rows - 1, 1),
        "peak_rss_mib": mib(m["peak_rss_bytes"]),
        "peak_growth_mib": mib(m["peak_delta_bytes"]),
    }


def random_model(folder: str):
    """The model of `folder`'s config with random weights (seed 0), and `folder`'s tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(folder)


def gpu_goal(results: list[dict], device: str, compiled: bool) -> dict:
    """The GPU rollout goal, from a GPU run of the default (eager) engine at batch 64 and 2k-token generations
    (benchmarks/rl_step.py copies it)."""
    rows = [r for r in results if r["batch"] == 64 and r["new_tokens"] >= 2048]
    if not device.startswith("cuda") or not rows or compiled:
        return {}
    value = min(r["speedup_tokens_per_s"] for r in rows)
    return {GPU_GOAL: {"value": value, "target": GPU_GOAL_TARGET, "met": value >= GPU_GOAL_TARGET, "command": command_line(),
                       "gpu": torch.cuda.get_device_name(device)}}  # fmt: skip


def parse_contexts(spec: str) -> list[tuple[int, int]]:
    """'512:512,1024:1024' -> [(512, 512), (1024, 1024)] (prompt tokens : new tokens)."""
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in spec.split(",") if item]
        if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--contexts {spec!r}: expected PROMPT:NEW[,PROMPT:NEW...]"
        ) from None
    return pairs  # type: ignore[return-value]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--batch", type=int, default=16, help="sequences per call")
    ap.add_argument("--group", type=int, default=1,
                    help="samples per prompt (GRPO group): batch/group distinct prompts; ours prefills each "
                    "prompt once, generate gets num_return_sequences=group (default 1: distinct prompts)")  # fmt: skip
    ap.add_argument("--contexts", type=parse_contexts, default=parse_contexts("512:512,1024:1024"),
                    help="comma-separated PROMPT:NEW token counts (default 512:512,1024:1024)")  # fmt: skip
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed runs per engine and context (median reported)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, ...)")
    ap.add_argument("--compile", action="store_true", help="our engine with engine.compile (torch.compile)")
    ap.add_argument("--random-weights", action="store_true",
                    help="random weights from the config beside --model (a Hugging Face folder): same speed")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="batch 4, context 64:32, one repeat, no JSON")
    ap.add_argument(
        "--out", default=None, help=f"JSON output (default {RESULTS / 'rollout.json'}; none with --quick)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.contexts, args.repeats = 4, [(64, 32)], 1
    if args.group < 1 or args.batch % args.group:
        ap.error(f"--group {args.group} must be >= 1 and divide --batch {args.batch}")
    return args


def measure_context(engine, model, tokenizer, args: argparse.Namespace, prompt_len: int, new: int) -> dict:
    """Both engines on one context, `--repeats` times alternating who goes first; medians and ratios."""
    prompts = make_prompts(tokenizer, args.batch // args.group, prompt_len)
    runs: dict[str, list[dict[str, float]]] = {"sparserl": [], "hf_generate": []}
    if args.compile:  # compile for this context's static shapes outside the timings
        print(
            f"context {prompt_len}+{new}: compile {run_ours(engine, prompts, new, args.seed, args.group)['total_s']:.1f} s"
        )
    for r in range(args.repeats):
        order = ("sparserl", "hf_generate") if r % 2 == 0 else ("hf_generate", "sparserl")
        for name in order:  # alternate who goes first: a machine that gets busier hurts both alike
            if name == "sparserl":
                runs[name].append(run_ours(engine, prompts, new, args.seed + r, args.group))
            else:
                runs[name].append(run_hf(model, tokenizer, prompts, new, args.seed + r, args.group))
        print(
            f"context {prompt_len}+{new} run {r + 1}/{args.repeats}: "
            f"ours {runs['sparserl'][-1]['total_s']:.1f} s, generate {runs['hf_generate'][-1]['total_s']:.1f} s",
            flush=True,
        )
    ours, hf = median_of(runs["sparserl"]), median_of(runs["hf_generate"])
    return {
        "prompt_tokens": prompt_len,
        "new_tokens": new,
        "context_tokens": prompt_len + new,
        "batch": args.batch,
        "group": args.group,
        "sparserl": ours,
        "hf_generate": hf,
        "speedup_tokens_per_s": ours["tokens_per_s"] / hf["tokens_per_s"],
        "speedup_prefill": ours["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"],
        "speedup_decode": ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"],
        "peak_growth_ratio": ours["peak_growth_mib"] / hf["peak_growth_mib"] if hf["peak_growth_mib"] else None,
        "runs": runs,
    }  # fmt: skip


def print_results(args: argparse.Namespace, results: list[dict]) -> None:
    rows = []
    for res in results:
        for name in ("sparserl", "hf_generate"):
            m = res[name]
            rows.append([
                f"{res['prompt_tokens']}+{res['new_tokens']}", name, m["tokens_per_s"], m["prefill_s"],
                m["prefill_tokens_per_s"], m["decode_s"], m["decode_tokens_per_s"], m["decode_step_s"],
                m["peak_rss_mib"], m["peak_growth_mib"],
            ])  # fmt: skip
        rows.append([
            "", "ratio", res["speedup_tokens_per_s"], "", res["speedup_prefill"], "", res["speedup_decode"], "",
            "", res["peak_growth_ratio"] if res["peak_growth_ratio"] is not None else "",
        ])  # fmt: skip
    print(
        f"\n{args.model}, batch {args.batch} (group {args.group}), fp32, {args.device}, {torch.get_num_threads()} thread(s), median of {args.repeats}"
    )
    print_table(
        ["context", "engine", "tok/s", "prefill s", "prefill tok/s", "decode s", "decode tok/s", "s/step",
         "peak RSS MiB", "peak growth MiB"],
        rows,
    )  # fmt: skip


@stoppable("benchmarks/rollout.py", "results not written; run it again", exits=True)
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out_path = args.out or (None if args.quick else str(RESULTS / "rollout.json"))
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    model, tokenizer = random_model(args.model) if args.random_weights else load_model(args.model)
    if model.config._attn_implementation == GROUPED_SDPA:
        # load_model's attention for teacher-forced passes: generate runs as a user runs it, on transformers' own
        # sdpa (our engine has its own attention)
        model.set_attn_implementation("sdpa")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on the GPU too, for both engines
    model.to(args.device)
    load_s = time.perf_counter() - t0
    engine = RolloutEngine(model, tokenizer, compile=args.compile)
    engine.eos_ids = set()  # EOS ignored, as min_new_tokens does for generate
    warm = make_prompts(tokenizer, 2, 16)  # one-time costs (allocator, first kernels) outside the timings
    run_ours(engine, warm, 4, args.seed)
    run_hf(model, tokenizer, warm, 4, args.seed)

    results = [measure_context(engine, model, tokenizer, args, p, n) for p, n in args.contexts]
    print_results(args, results)
    report = {
        "benchmark": "rollout: sparserl RolloutEngine (dense) vs transformers generate",
        "command": command_line(),
        "model": args.model + (" (random weights of its shape)" if args.random_weights else ""),
        "device": args.device,
        "engine_compile": args.compile,
        "dtype": "float32",
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "eos": "ignored"},
        "repeats": args.repeats,
        "model_load_s": load_s,
        "machine": machine_info(),
        "peak_rss_resettable": peak_is_resettable(),
        "results": results,
    }
    goals = gpu_goal(results, args.device, args.compile)
    if goals:
        report = {"goals": goals, **report}
        print(goals)
    if out_path:
        print(f"wrote {write_json(out_path, report)}")
    return report


if __name__ == "__main__":
    main()
