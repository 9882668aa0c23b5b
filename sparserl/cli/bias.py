"""`sparserl bias`: flags, a progress bar with time left, the console report; the work is in
sparserl/eval/bias_command.py (docs/bias.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from sparserl.cli.common import CONFIG_ARGS, arg, command


def _bias_epilog() -> str:
    return (
        "Each batch samples --prompts prompts x rollout.n twice with the same random streams: with the config's\n"
        "sampler (kv.method, rollout.sampler_temperature) and with the dense sampler at rollout.temperature, so\n"
        "a sample and its dense twin agree until the sparse cache changes a draw. Reported with 90% intervals:\n"
        "reward ratio and flips against the twins, divergence, k1/k3 (overall and after the first departure),\n"
        "log-gap per sequence, each correction's mask / veto / truncation share, KV saved against the dense\n"
        "engine's own allocation; and, per estimator, the gradient at pi_theta = pi_old against the dense one:\n"
        "cosine c_X, relative bias B_X and Gamma_X = ||E(g_naive - g_X)|| / ||E g_dense||, with a verdict:\n"
        "'corrections matter' (Gamma's lower bound >= 0.10 and c_X - c_naive's lower bound > 0), 'inert'\n"
        "(Gamma's upper bound < 0.05) or 'inconclusive'. See docs/bias.md.\n\n"
        "examples:\n"
        "  sparserl bias                                          # the embedded default (R-KV 80), K = 4\n"
        "  sparserl bias kv.method=dense rollout.sampler_temperature=1.3 --out bias-t13   # the positive control\n"
        "  sparserl bias --config my.yaml --batches 24 --estimators config,seq-is,tis --out bias-24\n"
        "  sparserl bias --out bias-24 --resume                  # continue after a stop\n"
        "  sparserl bias -K 24 --part 1/2 --out b & sparserl bias -K 24 --part 2/2 --out b; wait\n"
        "  sparserl bias -K 24 --out b --resume                  # two processes, then the report"
    )


def _part(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N) as (I, N)."""
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise argparse.ArgumentTypeError(f"--part {text!r}: expected I/N with 1 <= I <= N, e.g. 2/3")
    return int(i), int(n)


@command(
    "bias",
    "Measure whether this config's sparse sampler biases the update, and whether its corrections remove it.",
    *CONFIG_ARGS,
    arg("--prompts", type=int, default=None, help="prompts per batch (default: rollout.prompts_per_step)"),
    arg(
        "--batches",
        "-K",
        type=int,
        default=4,
        help="coupled batches K (default 4, minutes; intervals need >= 2, and 24 or more to hold their 90%% coverage: "
        "docs/bias.md)",
    ),
    arg(
        "--estimators",
        default="config,seq-is",
        help="gradient estimators besides naive, comma-separated: config (the config's own corrections), seq-is "
        "(sequence-level IS), or algo preset names (e.g. tis, icepop, smd); 'none': no gradients, rollout "
        "statistics only (default config,seq-is)",
    ),
    arg("--micro-batch", type=int, default=8, help="sequences per forward/backward (memory; default 8)"),
    arg(
        "--sketch-dim",
        type=int,
        default=None,
        help="reduce each gradient to this many CountSketch buckets (default: exact up to 8M trainable "
        "parameters, else 2^20)",
    ),
    arg("--draws", type=int, default=2000, help="bootstrap draws for the 90%% intervals (default 2000)"),
    arg(
        "--out", "-o", default=None, help="output folder (default: runs/bias-<kv.method>[-<kv.quant>]-<time>)"
    ),
    arg(
        "--resume", action="store_true", help="continue the measurement in --out (its saved batches are kept)"
    ),
    arg(
        "--part",
        type=_part,
        default=None,
        metavar="I/N",
        help="measure only the I-th of N contiguous shares of the batches and write no report: one measurement "
        "split over N processes or machines sharing --out (a batch depends only on its index); then --resume "
        "without --part writes the report",
    ),
    arg("--no-progress", action="store_true", help="no progress bar (logs, batch jobs)"),
    epilog=_bias_epilog,
)
def bias(args: argparse.Namespace) -> int:
    """`sparserl bias`: see sparserl/eval/bias_command.py."""
    from sparserl.config import ConfigError, load_config
    from sparserl.eval.bias_command import BiasSettings, measure

    cfg = load_config(args.config, args.overrides)
    names = [e.strip() for e in args.estimators.split(",") if e.strip()]
    gradients = names != ["none"]
    for flag, value, least in (("--batches", args.batches, 1), ("--micro-batch", args.micro_batch, 1),
                               ("--draws", args.draws, 10), ("--prompts", args.prompts or 1, 1)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{flag}={value} must be >= {least}")
    settings = BiasSettings(
        prompts=args.prompts or cfg.rollout.prompts_per_step, batches=args.batches,
        estimators=names if gradients else ["config"], gradients=gradients, micro_batch=args.micro_batch,
        sketch_dim=args.sketch_dim, draws=args.draws,
    )  # fmt: skip
    for flag, given in (("--resume", args.resume), ("--part", args.part)):
        if given and args.out is None:
            raise ConfigError(f"{flag} needs --out (the folder of the measurement to continue or share)")
    if args.part and args.part[1] > args.batches:
        raise ConfigError(f"--part {args.part[0]}/{args.part[1]}: more parts than --batches {args.batches}")
    out = args.out or f"runs/bias-{cfg.kv.short_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    command_line = shlex.join(["sparserl", "bias", *sys.argv[2:]])
    with _progress(not args.no_progress, args.batches) as progress:
        report = measure(cfg, settings, out, args.resume, progress, command=command_line, part=args.part)
    if report is None:
        print(
            f"part {args.part[0]}/{args.part[1]} saved in {out}/batches; once every part is done, the same "
            f"command with --resume and without --part writes the report"
        )
    else:
        print_report(report, out)
    return 0


def _progress(enabled: bool, total: int):
    """A context giving `progress(done, total)`: a rich bar with time left, or one line per batch."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    @contextmanager
    def bar():
        if not enabled:
            yield lambda done, n: print(f"batch {done}/{n} done", flush=True)
            return
        with Progress(TextColumn("bias"), BarColumn(), TextColumn("{task.completed}/{task.total} batches"),
                      TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn()) as p:  # fmt: skip
            task = p.add_task("bias", total=total)
            yield lambda done, n: p.update(task, completed=done, total=n)

    return bar()


def _fmt(v: dict | None, digits: int = 3) -> str:
    if not v or v.get("value") is None:
        return "n/a"
    if v.get("low") is None:
        return f"{v['value']:.{digits}f}"
    return f"{v['value']:.{digits}f} [{v['low']:.{digits}f}, {v['high']:.{digits}f}]"


def print_report(report: dict, out: str) -> None:
    """The main numbers and one verdict line per estimator."""
    from sparserl.eval.bias_stats import COVERING_BATCHES

    r = report["rollout"]
    print(f"sampler: {report['sampler']}")
    print(f"{report['prompts']} prompts in {report['batches_done']} batches; 90% intervals")
    for label, key in (("reward ratio to dense twins", "reward_ratio"), ("reward flips", "reward_flip_rate"),
                       ("samples diverged from twin", "diverged_share"), ("k3 per token", "k3_token"),
                       ("k3 after first departure", "k3_after_departure"), ("log-gap per sequence", "log_gap_seq"),
                       ("KV saved (mean held)", "kv_saving_mean_held"), ("KV saved (peak allocation)",
                       "kv_saving_peak")):  # fmt: skip
        print(f"  {label:<30} {_fmt(r.get(key))}")
    for name, g in report.get("estimators", {}).items():
        line = f"  {name:<10} c={_fmt(g['cosine'])}  B={_fmt(g['relative_bias'])}"
        if "gamma" in g:
            line += f"  Gamma={_fmt(g['gamma'])}  -> {g['verdict']}"
        print(line)
    if report.get("estimators") and report["batches_done"] < COVERING_BATCHES:
        print(f"  (at {report['batches_done']} batches these intervals hold less than their 90%: verdicts are "
              f"provisional; --batches {COVERING_BATCHES} --resume adds batches)")  # fmt: skip
    print(f"report: {out}/bias.json, plot: {out}/bias.png")
