"""The `sparserl` command. Each subcommand is one function registered with `@command(...)`:

    @command("plot", "Draw a run's curves to PNG.", arg("run_dir", help="..."), arg("--out", default=None))
    def plot(args: argparse.Namespace) -> int:
        from sparserl.plot import main   # import heavy modules inside, so `sparserl --help` stays fast
        return main(args.run_dir, args.out)

Bad input (a `sparserl.errors.UserError`: config, data, model; or an OSError about the user's files: missing,
not writable, disk full) prints one clear `error:` line and exits non-zero; anything else is a bug and keeps
its traceback. SIGTERM ends a command with one 'stopped by SIGTERM' line and exit code 143 (sparserl.signals).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from sparserl.cli.common import COMMANDS, MODEL_LOAD_ARGS, ROW_FIELD_ARGS, Arg, Command, arg, command

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
HELP_ORDER = (
    "train",
    "eval",
    "bias",
    "rollout",
    "plot",
    "calibrate",
    "cost",
)  # how `sparserl --help` lists them


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
    rank = {name: i for i, name in enumerate(HELP_ORDER)}  # commands registered elsewhere come last
    for cmd in sorted(COMMANDS.values(), key=lambda c: rank.get(c.name, len(rank))):
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
    # Idle OpenMP threads spin ~10 us, then sleep. benchmarks/shared_cpu.py (docs/results/shared_cpu.json; a
    # SmolLM2-135M rollout, 8 x 64 tokens, 2 threads on 2 cores, alone / beside a one-core busy process):
    # libgomp's default ~3 ms spin took 6.3 s / 26.0 s (4.2x), OMP_WAIT_POLICY=PASSIVE 9.8 s / 11.3 s, one thread
    # 9.5-10.3 s / 9.6-11.0 s, GOMP_SPINCOUNT=1000 8.8 s / 11.9 s (1.3x). KMP_BLOCKTIME=0 makes LLVM and Intel
    # OpenMP sleep at once, as PASSIVE did (torch's Linux wheels load libgomp, which ignores it). Set before torch
    # is imported; a user's own OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME wins, and then none is set
    # (GOMP_SPINCOUNT would override their policy).
    if not any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
        os.environ["GOMP_SPINCOUNT"] = "1000"
        os.environ["KMP_BLOCKTIME"] = "0"
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return EXIT_USAGE
    from sparserl.config import ConfigError
    from sparserl.errors import UserError
    from sparserl.signals import StopOnSignal, Terminated

    try:
        with StopOnSignal():  # train and calibrate install their own, stopping more gently
            return int(args._run(args) or 0)
    except Terminated as e:
        print(f"sparserl {args.command}: stopped by {e.name}", file=sys.stderr)
        return e.exit_code
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


# The subcommands register themselves with @command (sparserl.cli.common) when imported.
from sparserl.cli import bias, evaluation, tools, train  # noqa: E402, F401

__all__ = [
    "COMMANDS",
    "MODEL_LOAD_ARGS",
    "ROW_FIELD_ARGS",
    "Arg",
    "Command",
    "arg",
    "build_parser",
    "command",
    "main",
]
