"""The `sparserl` command's registry: `@command(...)` registers a subcommand, `arg(...)` declares one of its
arguments, and the argument groups several subcommands share. A leaf module: the subcommand modules
(sparserl/cli/train.py, evaluation.py, tools.py) import it, never the package's __init__, which imports them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Arg:
    """The positional and keyword arguments of one `ArgumentParser.add_argument` call."""

    flags: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def arg(*flags: str, **kwargs: Any) -> Arg:
    """Declare an argument of a subcommand, exactly as `parser.add_argument(*flags, **kwargs)`."""
    return Arg(flags, kwargs)


MAX_THREADS = 4096  # torch takes a C int; no machine has more cores


def threads(text: str) -> int:
    """argparse type of --threads: torch CPU threads, 0 for torch's default."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of threads") from None
    if not 0 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(
            f"{value} must be >= 0 (0 leaves torch's default) and <= {MAX_THREADS}"
        )
    return value


# Argument groups that several subcommands share (eval, calibrate): which rows, and how the model is loaded.
CONFIG_ARGS = (  # a TrainConfig from YAML + overrides: train, bias
    arg(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. optim.lr=1e-5 kv.budget=256"
    ),
    arg(
        "--config",
        "-c",
        default=None,
        help="YAML config file or run preset name; default: the embedded default",
    ),
)
ROW_FIELD_ARGS = (
    arg("--split", default="test", help="dataset split for Hugging Face datasets and procedural tasks"),
    arg("--question-key", default="", help="row field of the question (default: auto-detect)"),
    arg("--answer-key", default="", help="row field of the reference answer (default: auto-detect)"),
)
MODEL_LOAD_ARGS = (
    arg(
        "--checkpoint",
        action="store_true",
        help="with a run directory: use its latest checkpoint, not final/",
    ),
    arg("--dtype", default=None, help="float32, bfloat16 or float16 (default: float32, or the run's)"),
    arg("--device", default=None, help="torch device (default: cuda when available, else cpu)"),
    arg("--threads", type=threads, default=0, help="torch CPU threads; 0 leaves torch's default"),
)


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
