"""`sparserl eval` and `sparserl rollout`: flags; the work is in sparserl/eval/commands.py."""

from __future__ import annotations

import argparse

from sparserl.cli.common import MODEL_LOAD_ARGS, ROW_FIELD_ARGS, arg, command, threads

# ---------------------------------------------------------------------------------------------- eval


def _eval_epilog() -> str:
    return (
        "--model: a training run directory (its exported final/ model, else its latest checkpoint: base model\n"
        "  + weights or LoRA adapter), RUN_DIR/checkpoints/step-N, a Hugging Face id or folder, a .gguf file,\n"
        "  or smollm2-135m.\n"
        "--data: arithmetic, long_arithmetic (built in, procedural), a .jsonl/.json/.parquet file (e.g.\n"
        "  math500.jsonl), gsm8k (test split, from the Hugging Face Hub), math500, aime24, amc23,\n"
        "  gaokao2023en, minerva_math, olympiadbench (eval/NAME.jsonl, and gsm8k/test.jsonl before the Hub,\n"
        "  in the folder $SPARSERL_DATA_DIR names, if set; else give the file), or a Hugging Face dataset\n"
        "  name; omitted with a run directory: the run's own task.\n\n"
        "Without --kv only dense inference runs; with --kv METHOD, dense and sparse inference sample the\n"
        "same prompts with the same seeds (--no-dense: sparse only). The JSON report (stdout)\n"
        "holds mean@k, pass@k for k = 1, 2, 4, ..., samples (unbiased estimator), mean completion length,\n"
        "truncated share and KV stats per inference mode, and their sparse - dense differences; --out also\n"
        "stores per-prompt rewards.\n\n"
        "examples:\n"
        "  sparserl eval --model smollm2-135m --data arithmetic --kv rkv --budget 64 --samples 4 --limit 20\n"
        "  sparserl eval --model runs/<run> --data gsm8k --kv snapkv --budget 256 \\\n"
        "      --samples 8 --limit 100 --max-new-tokens 512 --out gsm8k-eval.json"
    )


@command(
    "eval",
    "Evaluate a model under dense (and, with --kv, sparse) inference: mean@k and pass@k as JSON.",
    arg("--model", "-m", default="smollm2-135m", help="run directory, HF id/folder, .gguf or smollm2-135m"),
    arg("--data", "-d", default=None, help="eval file, gsm8k, an eval set name, or a built-in task"),
    arg(
        "--kv",
        default=None,
        help="also evaluate sparse inference with this kv.method (any but dense: `sparserl train --help` lists "
        "them under kv.method); default: dense only",
    ),
    arg(
        "--budget", type=int, default=None, help="with --kv: retained KV positions per sequence (default 512)"
    ),
    arg(
        "--window",
        type=int,
        default=None,
        help="with --kv: always-kept recent positions (default: KVConfig's)",
    ),
    arg(
        "--interval",
        type=int,
        default=None,
        help="with --kv: decode steps between compressions (default: KVConfig's)",
    ),
    arg(
        "--samples", "-k", type=int, default=4, help="completions per prompt, k of mean@k/pass@k (default 4)"
    ),
    arg(
        "--limit",
        type=int,
        default=None,
        help="first N prompts; 0: all (default: all rows, 200 for procedural tasks)",
    ),
    arg(
        "--max-new-tokens",
        type=int,
        default=None,
        help="completion length cap (default: a run directory's rollout.max_new_tokens, else training's "
        "default, 64)",
    ),
    arg("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default 0.8)"),
    arg("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)"),
    arg("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default)"),
    arg("--seed", type=int, default=0, help="sampling seed, shared by dense and sparse inference"),
    arg("--batch-prompts", type=int, default=8, help="prompts per generate call (default 8)"),
    *ROW_FIELD_ARGS,
    arg(
        "--prompt-template",
        default="",
        help="build the question from row fields, e.g. '{body} {question}' (default: the question field)",
    ),
    arg(
        "--kv-quant",
        default=None,
        help="also evaluate with quantized KV (kv.quant: int8 or fp8; with --kv, of that method's cache, "
        "else of a dense one); default none",
    ),
    arg(
        "--no-dense", action="store_true", help="with --kv or --kv-quant: skip dense inference (sparse only)"
    ),
    *MODEL_LOAD_ARGS,
    arg(
        "--out", "-o", default=None, help="also write the report, with per-prompt results, to this JSON file"
    ),
    arg("--quiet", "-q", action="store_true", help="no progress or table on stderr"),
    epilog=_eval_epilog,
)
def eval_(args: argparse.Namespace) -> int:
    """`sparserl eval`: see sparserl/eval/commands.py."""
    from sparserl.eval.commands import eval_command

    return eval_command(args)


@command(
    "rollout",
    "Demo of the rollout engine: sample a few completions, show tokens/s and KV memory vs a dense cache.",
    arg("--model", "-m", default="smollm2-135m", help="HF id/folder, .gguf, run directory or smollm2-135m"),
    arg("--task", default="arithmetic", help="prompts: arithmetic, long_arithmetic, gsm8k, or a data file"),
    arg(
        "--question-key",
        default="",
        help="with a data file: row field of the question (default: auto-detect)",
    ),
    arg("--answer-key", default="", help="with a data file: row field of the answer (default: auto-detect)"),
    arg("--kv", default="rkv", help="a kv.method (`sparserl train --help` lists them; default rkv)"),
    arg("--budget", type=int, default=128, help="retained KV positions per sequence (default 128)"),
    arg("--window", type=int, default=None, help="always-kept recent positions (default: KVConfig's)"),
    arg("--interval", type=int, default=16, help="decode steps between compressions (default 16)"),
    arg("--kv-quant", default=None, help="kv.quant: none, int8 or fp8 keys and values (default none)"),
    arg("--prompts", type=int, default=2, help="prompts (default 2)"),
    arg("--n", type=int, default=2, help="completions per prompt (default 2)"),
    arg("--max-new-tokens", type=int, default=192, help="completion length cap (default 192)"),
    arg("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)"),
    arg("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)"),
    arg("--seed", type=int, default=0, help="sampling seed"),
    arg("--show", type=int, default=4, help="completions printed (default 4)"),
    arg("--device", default=None, help="torch device (default: cuda when available, else cpu)"),
    arg("--threads", type=threads, default=0, help="torch CPU threads; 0 leaves torch's default"),
)
def rollout(args: argparse.Namespace) -> int:
    """`sparserl rollout`: see sparserl/eval/commands.py."""
    from sparserl.eval.commands import rollout_command

    return rollout_command(args)
