"""The `sparserl` command. Each subcommand is one function registered with `@command(...)`:

    @command("plot", "Draw a run's curves to PNG.", arg("run_dir", help="..."), arg("--out", default=None))
    def plot(args: argparse.Namespace) -> int:
        from sparserl.plot import main   # import heavy modules inside, so `sparserl --help` stays fast
        return main(args.run_dir, args.out)

Bad input (a `sparserl.errors.UserError`: config, data, model; or an OSError about the user's files: missing,
not writable, disk full) prints one clear `error:` line and exits non-zero; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


@dataclass
class Arg:
    """The positional and keyword arguments of one `ArgumentParser.add_argument` call."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def arg(*flags: str, **kwargs: Any) -> Arg:
    """Declare an argument of a subcommand, exactly as `parser.add_argument(*flags, **kwargs)`."""
    return Arg(flags, kwargs)


@dataclass
class Command:
    """A registered subcommand."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    args: tuple[Arg, ...]
    epilog: Callable[[], str] | None = None


COMMANDS: dict[str, Command] = {}


def command(
    name: str, help: str, *args: Arg, epilog: Callable[[], str] | None = None
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Register `fn(args) -> exit code` as `sparserl NAME`; `epilog` (lazy) is appended to its --help."""

    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        if name in COMMANDS:
            raise ValueError(f"sparserl subcommand {name!r} is registered twice")
        COMMANDS[name] = Command(name, help, fn, args, epilog)
        return fn

    return deco


class _LazyEpilogParser(argparse.ArgumentParser):
    """Builds the (long) epilog only when help is actually printed."""

    def __init__(self, *a: Any, epilog_fn: Callable[[], str] | None = None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self._epilog_fn = epilog_fn

    def format_help(self) -> str:
        if self._epilog_fn is not None and self.epilog is None:
            self.epilog = self._epilog_fn()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    from sparserl import __version__

    parser = argparse.ArgumentParser(
        prog="sparserl",
        description="RL of language models (GRPO family) with rollouts on a sparse KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"sparserl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_LazyEpilogParser)
    for cmd in COMMANDS.values():
        p = sub.add_parser(
            cmd.name,
            help=cmd.help,
            description=cmd.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog_fn=cmd.epilog,
        )
        for a in cmd.args:
            p.add_argument(*a.flags, **a.kwargs)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sparserl` console script."""
    # Idle OpenMP threads sleep instead of spinning: on a shared or busy CPU, spinning threads slowed small
    # matmuls ~8x here (2 cores, other processes running). Set before torch is imported; a user's value wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return EXIT_USAGE
    from sparserl.config import ConfigError
    from sparserl.errors import UserError

    try:
        return int(args._run(args) or 0)
    except ConfigError as e:
        print(f"sparserl {args.command}: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except UserError as e:
        print(f"sparserl {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as e:
        if not is_user_file_error(e):
            raise
        print(f"sparserl {args.command}: error: {describe_os_error(e)}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"sparserl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


# A file or directory the user named (or the disk it lives on) cannot be used: say so in one line.
USER_FILE_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)
USER_FILE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)


def is_user_file_error(e: OSError) -> bool:
    """An OSError about the user's files or disk (missing, not writable, full), not a bug."""
    return isinstance(e, USER_FILE_ERRORS) or e.errno in USER_FILE_ERRNOS


def describe_os_error(e: OSError) -> str:
    """'No space left on device: PATH' for an error from the OS; the message alone for our own raises."""
    if e.strerror is None:
        return str(e)
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    return f"{e.strerror}: {paths}" if paths else e.strerror


# ---------------------------------------------------------------------------------------------- train


def _train_epilog() -> str:
    from sparserl.algo import PRESETS
    from sparserl.config import CONFIG_DIR, format_help, list_run_presets

    return (
        "examples:\n"
        "  sparserl train                                   # the embedded default (SmolLM2-135M, arithmetic, sparse-rl + R-KV)\n"
        "  sparserl train --config configs/dense.yaml optim.lr=1e-5 trainer.steps=50\n"
        "  sparserl train --resume runs/sparse-rl-rkv-20250101-120000 trainer.steps=100\n\n"
        f"run presets (--config NAME, from {CONFIG_DIR}): {', '.join(list_run_presets()) or '(none)'}\n"
        f"algo presets (algo.preset=NAME): {', '.join(PRESETS)}\n\n"
        "config keys (override any with section.key=value; lists comma-separated or [a, b]; null for none):"
        + format_help()
    )


@command(
    "train",
    "Train a policy with GRPO-family RL on sparse (or dense) rollouts, from a YAML config plus key=value overrides.",
    arg(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. optim.lr=1e-5 kv.budget=256"
    ),
    arg(
        "--config",
        "-c",
        default=None,
        help="YAML config file or run preset name; default: the embedded default",
    ),
    arg(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="RUN_DIR",
        help="continue a run from its latest checkpoint (with no RUN_DIR: the newest run under trainer.output_dir)",
    ),
    arg("--print-config", action="store_true", help="print the resolved config as YAML and exit"),
    epilog=_train_epilog,
)
def train(args: argparse.Namespace) -> int:
    """`sparserl train`: resolve the config, run the loop, print the summary."""
    import yaml

    from sparserl.config import ConfigError, load_config

    if args.resume is not None and args.config is not None:
        raise ConfigError("--resume uses the run's own config.yaml; pass overrides (key=value), not --config")
    run_dir = None
    if args.resume and "=" in args.resume and not os.path.isdir(args.resume):
        # `--resume key=value`: argparse took the first override for RUN_DIR
        args.overrides.insert(0, args.resume)
        args.resume = ""
    if args.resume is not None:
        from sparserl.trainer import find_resumable, resume_config

        run_dir = args.resume or find_resumable(load_config(None, args.overrides).trainer.output_dir)
        cfg = resume_config(run_dir, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0

    from rich.console import Console

    from sparserl.trainer import Trainer
    from sparserl.trainer.logging import render_summary

    console = Console(stderr=True)
    trainer = Trainer(cfg, run_dir, resume=args.resume is not None, console=console)
    console.print(
        f"[bold]sparserl train[/bold] -> {trainer.run_dir}  (model {cfg.model.spec}, task {cfg.task.name}, "
        f"algo {cfg.algo.preset}, rollouts {'sparse ' + cfg.kv.method if cfg.sparse else 'dense'}, "
        f"{cfg.trainer.steps} steps x {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n})",
        highlight=False,
        soft_wrap=True,
    )
    try:
        summary = trainer.train()
    except KeyboardInterrupt:
        console.print(interrupted_hint(trainer.run_dir), highlight=False, soft_wrap=True)
        raise
    render_summary(summary, console)
    return 0


def interrupted_hint(run_dir: str | os.PathLike[str]) -> str:
    """How to go on after Ctrl-C: --resume from the latest checkpoint, or (none written yet) start again."""
    from sparserl.trainer import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return (
            f"interrupted before the first checkpoint: nothing was saved to {run_dir}; "
            "run the same command to start again"
        )
    return f"interrupted; {checkpoint.name} was saved; continue with: sparserl train --resume {run_dir}"


# ---------------------------------------------------------------------------------------------- eval


def _eval_epilog() -> str:
    return (
        "--model: a training run directory (its exported final/ model, else its latest checkpoint: base model\n"
        "  + weights or LoRA adapter), RUN_DIR/checkpoints/step-N, a Hugging Face id or folder, a .gguf file,\n"
        "  or smollm2-135m.\n"
        "--data: a .jsonl/.json/.parquet file (e.g. ../shared/data/eval/math500.jsonl), gsm8k (test split),\n"
        "  math500, aime24, amc23, gaokao2023en, minerva_math, olympiadbench (the shared eval files),\n"
        "  arithmetic, long_arithmetic (procedural), or a Hugging Face dataset name; omitted with a run\n"
        "  directory: the run's own task.\n\n"
        "Without --kv only dense inference runs; with --kv METHOD, dense and sparse inference sample the\n"
        "same prompts with the same seeds (--no-dense: sparse only). The JSON report (stdout)\n"
        "holds mean@k, pass@k for k = 1, 2, 4, ..., samples (unbiased estimator), mean completion length,\n"
        "truncated share and KV stats per inference mode, and their sparse - dense differences; --out also\n"
        "stores per-prompt rewards.\n\n"
        "examples:\n"
        "  sparserl eval --model smollm2-135m --data arithmetic --kv rkv --budget 64 --samples 4 --limit 20\n"
        "  sparserl eval --model runs/<run> --data ../shared/data/gsm8k/test.jsonl --kv snapkv --budget 256 \\\n"
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
        help="also evaluate sparse inference with this KV method (rkv, snapkv, h2o, streaming_llm, random); "
        "default: dense only",
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
    arg("--max-new-tokens", type=int, default=1024, help="completion length cap (default 1024)"),
    arg("--temperature", type=float, default=0.8, help="sampling temperature, 0 = greedy (default 0.8)"),
    arg("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)"),
    arg("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 disables (default)"),
    arg("--seed", type=int, default=0, help="sampling seed, shared by dense and sparse inference"),
    arg("--batch-prompts", type=int, default=8, help="prompts per generate call (default 8)"),
    arg("--split", default="test", help="dataset split for Hugging Face datasets and procedural tasks"),
    arg("--question-key", default="", help="row field of the question (default: auto-detect)"),
    arg("--answer-key", default="", help="row field of the reference answer (default: auto-detect)"),
    arg(
        "--prompt-template",
        default="",
        help="build the question from row fields, e.g. '{body} {question}' (default: the question field)",
    ),
    arg("--no-dense", action="store_true", help="with --kv: skip dense inference (sparse only)"),
    arg(
        "--checkpoint",
        action="store_true",
        help="with a run directory: use its latest checkpoint, not final/",
    ),
    arg("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32, or the run's)"),
    arg("--device", default=None, help="torch device (default: cuda when available, else cpu)"),
    arg("--threads", type=int, default=0, help="torch CPU threads; 0 leaves torch's default"),
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
    arg(
        "--kv", default="rkv", help="KV method: dense, rkv, snapkv, h2o, streaming_llm, random (default rkv)"
    ),
    arg("--budget", type=int, default=128, help="retained KV positions per sequence (default 128)"),
    arg("--window", type=int, default=None, help="always-kept recent positions (default: KVConfig's)"),
    arg("--interval", type=int, default=16, help="decode steps between compressions (default 16)"),
    arg("--prompts", type=int, default=2, help="prompts (default 2)"),
    arg("--n", type=int, default=2, help="completions per prompt (default 2)"),
    arg("--max-new-tokens", type=int, default=192, help="completion length cap (default 192)"),
    arg("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)"),
    arg("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)"),
    arg("--seed", type=int, default=0, help="sampling seed"),
    arg("--show", type=int, default=4, help="completions printed (default 4)"),
    arg("--device", default=None, help="torch device (default: cuda when available, else cpu)"),
    arg("--threads", type=int, default=0, help="torch CPU threads; 0 leaves torch's default"),
)
def rollout(args: argparse.Namespace) -> int:
    """`sparserl rollout`: see sparserl/eval/commands.py."""
    from sparserl.eval.commands import rollout_command

    return rollout_command(args)


# ---------------------------------------------------------------------------------------------- plot


@command(
    "plot",
    "Draw a run's curves (reward, length, mismatch, rejection, KV, optimizer) to PNG; several runs overlay.",
    arg("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files) to draw"),
    arg(
        "--out",
        "-o",
        default=None,
        help="output directory (default: RUN_DIR/plots; ./plots for several runs)",
    ),
    arg("--smooth", type=int, default=0, help="moving-average window drawn over the raw curves (0: off)"),
)
def plot(args: argparse.Namespace) -> int:
    """`sparserl plot`: see sparserl/plot.py."""
    from sparserl.plot import main as plot_main

    return plot_main(args.runs, args.out, args.smooth)


# ---------------------------------------------------------------------------------------------- cost


def _cost_epilog() -> str:
    from sparserl.cost.probe import INTENSITY_PRESETS

    presets = ", ".join(f"{name} = {value:.3g}" for name, value in INTENSITY_PRESETS.items())
    return (
        f"--intensity presets (FLOPs per byte): {presets}\n\n"
        "examples:\n"
        "  sparserl cost --prompt-len 64 --output-len 8000 --n 16 --budget 1024\n"
        "  sparserl cost --schedule calibrated.json --methods dense,block_topk --mem-cap 4GiB --json\n"
        "  sparserl cost --model path/to/Qwen3-1.7B --dtype bfloat16 --intensity h200 --n 8 --output-len 16000\n"
        "  sparserl cost --probe --threads 1                     # measure I on this CPU\n"
        "  sparserl cost --probe-decode 64,2048 --methods dense,h2o   # check the model against the engine\n"
        "See docs/cost_model.md."
    )


@command(
    "cost",
    "Predict the rollout speed-up and memory of dense, eviction and block-sparse KV from a cost model.",
    arg("--model", "-m", default="smollm2-135m", help="model folder, .gguf or smollm2-135m (config only)"),
    arg("--dtype", default="float32", help="float32, bfloat16 or float16: bytes per weight and KV element"),
    arg("--prompt-len", type=int, default=64, help="prompt tokens (default 64)"),
    arg("--output-len", type=int, default=4096, help="new tokens per sample, EOS ignored (default 4096)"),
    arg("--n", type=int, default=16, help="samples of the prompt decoded together (default 16)"),
    arg("--methods", default="dense,rkv,block_topk", help="kv.method names, comma-separated (dense always)"),
    arg("--budget", type=int, default=512, help="KV budget of the sparse methods (default 512)"),
    arg("--schedule", help="replaces --budget: [[from_length, budget], ...] or a JSON/YAML file"),
    arg("--interval", type=int, default=128, help="eviction: decode steps between cuts (default 128)"),
    arg("--page-size", type=int, default=16, help="block_topk: tokens per page (default 16)"),
    arg("--dense-layers", default="0,1", help="block_topk: layers that stay dense (default 0,1)"),
    arg("--intensity", default="cpu-1t", help="FLOPs per byte: a number or a preset (default cpu-1t)"),
    arg("--mem-cap", default="4GiB", help="KV memory for the 'seqs at cap' column (default 4GiB)"),
    arg("--json", action="store_true", help="print the report as JSON"),
    arg("--probe", action="store_true", help="instead, measure this machine's FLOPs per byte (--threads)"),
    arg("--probe-decode", metavar="LENGTHS", help="instead, time the engine's steps at these prompt lengths"),
    arg("--decode-steps", type=int, default=17, help="--probe-decode: new tokens per timing (default 17)"),
    arg("--repeats", type=int, default=3, help="--probe-decode: timings per cell, interleaved (default 3)"),
    arg("--threads", type=int, default=1, help="--probe, --probe-decode: torch threads (default 1)"),
    epilog=_cost_epilog,
)
def cost(args: argparse.Namespace) -> int:
    """`sparserl cost`: see sparserl/cost/report.py."""
    from sparserl.cost.report import cost_command

    return cost_command(args)


if __name__ == "__main__":
    sys.exit(main())
