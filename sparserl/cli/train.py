"""`sparserl train`: the config, the run, one-line errors, an honest Ctrl-C message, and a SIGTERM that finishes
the step, saves a checkpoint and exits 143 (sparserl.signals)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from sparserl.cli.common import CONFIG_ARGS, arg, command
from sparserl.signals import StopOnSignal, Terminated, stop_between_steps

# ---------------------------------------------------------------------------------------------- train


def _train_epilog() -> str:
    from sparserl.algo import PRESETS
    from sparserl.algo.presets import LOSS_PRESETS
    from sparserl.config import CONFIG_DIR, format_help, list_run_presets
    from sparserl.rollout import GROUP_SOURCES

    return (
        "examples:\n"
        "  sparserl train                                   # the embedded default (SmolLM2-135M, arithmetic, sparse-rl + R-KV)\n"
        "  sparserl train --config configs/dense.yaml optim.lr=1e-5 trainer.steps=50\n"
        "  sparserl train --resume runs/sparse-rl-rkv-20250101-120000 trainer.steps=100\n\n"
        f"run presets (--config NAME, from {CONFIG_DIR}): {', '.join(list_run_presets()) or '(none)'}\n"
        f"algo presets (algo.preset=NAME, or ROLLOUT+LOSS e.g. sparse-rl+gspo): rollout presets "
        f"{', '.join(n for n in PRESETS if n not in LOSS_PRESETS)}; loss presets {', '.join(LOSS_PRESETS)} (a "
        "loss preset sets only the loss and keeps the config's rollout preset and corrections)\n\n"
        "config keys (override any with section.key=value; lists comma-separated or [a, b]; null for none):"
        + format_help()
        + f"\n\ngroup sources (sampling.method=NAME): {GROUP_SOURCES.described()}"
    )


@command(
    "train",
    "Train a policy with GRPO-family RL on sparse (or dense) rollouts, from a YAML config plus key=value overrides.",
    *CONFIG_ARGS,
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
    from sparserl.config.model_fit import check_fits_model

    check_fits_model(cfg)  # before the run directory exists

    from rich.console import Console

    from sparserl.trainer import Trainer
    from sparserl.trainer.console import header, notes
    from sparserl.trainer.logging import render_summary

    console = Console(stderr=True)
    with StopOnSignal(notify=lambda m: console.print(m, highlight=False, soft_wrap=True)) as stop:
        try:
            trainer = Trainer(cfg, run_dir, resume=args.resume is not None, console=console)
        except Terminated as e:
            hint = interrupted_hint(run_dir) if run_dir else "run the same command to start again"
            console.print(f"stopped by {e.name} before training started; {hint}", soft_wrap=True)
            return e.exit_code
        for line in [header(cfg, trainer.run_dir), *notes(cfg)]:
            console.print(line, highlight=False, soft_wrap=True)
        stop_between_steps(trainer, stop)
        try:
            summary = trainer.train()
        except Terminated as e:
            console.print(terminated_hint(trainer, stop, e), highlight=False, soft_wrap=True)
            return e.exit_code
        except KeyboardInterrupt:
            console.print(interrupted_hint(trainer.run_dir), highlight=False, soft_wrap=True)
            raise
    if stop.requested is not None:
        console.print("SIGTERM came after the last step: the run is complete", highlight=False)
    render_summary(summary, console)
    return 0


def terminated_hint(trainer: Any, stop: StopOnSignal, e: Terminated) -> str:
    """After a SIGTERM: between steps, save the step just finished (unless its checkpoint exists) and say how
    to resume; mid-step (a second signal), say which checkpoint the resume starts from."""
    from sparserl.trainer import latest_checkpoint

    step = trainer.state.step
    if e.at_safe_point and step > 0:
        latest = latest_checkpoint(trainer.run_dir)
        if latest is None or int(latest.name.rpartition("-")[2]) < step:
            stop.shielded = True  # a further SIGTERM must not cut the save short
            trainer.save()
        trainer.close()
        return (
            f"stopped by {e.name} after step {step}; " + interrupted_hint(trainer.run_dir).partition("; ")[2]
        )
    return f"stopped by {e.name} mid-step; " + interrupted_hint(trainer.run_dir)


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
