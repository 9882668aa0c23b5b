"""The `sparserl` command. Each subcommand is one function registered with `@command(...)`:

    @command("plot", "Draw a run's curves to PNG.", arg("run_dir", help="..."), arg("--out", default=None))
    def plot(args: argparse.Namespace) -> int:
        from sparserl.plot import main   # import heavy modules inside, so `sparserl --help` stays fast
        return main(args.run_dir, args.out)

Bad input (a config error, a missing file or model) prints one clear `error:` line and exits non-zero.
"""

from __future__ import annotations

import argparse
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return EXIT_USAGE
    from sparserl.config import ConfigError
    from sparserl.models import ModelLoadError

    try:
        return int(args._run(args) or 0)
    except ConfigError as e:
        print(f"sparserl {args.command}: config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, FileExistsError, ModelLoadError) as e:
        print(f"sparserl {args.command}: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"sparserl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


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
    )
    try:
        summary = trainer.train()
    except KeyboardInterrupt:
        console.print(f"interrupted; continue with: sparserl train --resume {trainer.run_dir}")
        raise
    render_summary(summary, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
