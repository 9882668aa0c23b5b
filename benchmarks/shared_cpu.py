"""Threads on a shared machine: does a rollout beside another busy process slow down in proportion to the cores
it lost, or far more?

For each setting (torch threads, `OMP_WAIT_POLICY`, libgomp's `GOMP_SPINCOUNT`: how long an idle OpenMP thread
spins before it sleeps; unset policy = 300000 spins, about 3 ms, PASSIVE = 0) a child process, its environment
set before torch is imported, loads SmolLM2-135M (fp32) and times one fixed workload twice: alone, and beside a
one-core burner (a separate `while True: pass` process started 1 s before and killed after). The workload is
`RolloutEngine.generate` of one chat prompt x `--n` samples, `--tokens` new tokens, temperature 1, EOS ignored,
after a short warm-up call. Settings alternate (their order reversed on odd repeats, and alone/beside swapped);
medians over `--repeats` of wall and CPU seconds (CPU: all the child's threads, spinning included). Also
recorded: the burner's CPU seconds during the timed call, and the CPU seconds of every other process (from
/proc/stat). Each child waits for a quiet machine, and one that a third process or the hypervisor (steal: another
virtual machine on the host) disturbed (> 0.15 core) runs
again once, so that someone else's work on the machine is not counted as the setting's. The goal is the slowdown (wall beside /
wall alone) of `--chosen`, the library's default, against cores / (cores - 1): one core lost of two, 2.0x.

    python benchmarks/shared_cpu.py            # 9 settings x 2 repeats, ~15 min -> docs/results/shared_cpu.json
    python benchmarks/shared_cpu.py --resume   # the same, measuring again only the runs others disturbed
    python benchmarks/shared_cpu.py --quick    # 2 settings, 8 tokens, 1 repeat, a temp file: a smoke run
"""

# ruff: noqa: E402  (the benchmarks folder goes on sys.path before its helpers are imported)
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info, print_table, write_json

from sparserl.signals import stoppable

# THREADS/OMP_WAIT_POLICY/GOMP_SPINCOUNT, "-" = unset. 1 thread first: its policy should not matter.
DEFAULT_SETTINGS = (
    "1/PASSIVE/-,1/-/-,2/PASSIVE/-,2/-/-,2/-/1000,2/-/10000,2/-/30000,2/-/100000,2/PASSIVE/1000"
)
# The `sparserl` command's default on a 2-core machine (trainer.threads 0 = all cores): libgomp spins 1000 times
# before it sleeps (GOMP_SPINCOUNT, no OMP_WAIT_POLICY; the command's KMP_BLOCKTIME=0 is for other OpenMP runtimes
# and nothing in torch's Linux wheel reads it).
DEFAULT_CHOSEN = "2/-/1000"
ENV_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PROMPT = "A train leaves at 9:40 and arrives at 13:05. How many minutes is the trip? Explain step by step."
BURNER = "while True: pass"
DISTURBED = 0.15  # cores taken by other processes or stolen by the host during a timed call: a disturbed run


def parse_setting(text: str) -> dict[str, Any]:
    """`2/PASSIVE/-` -> {"threads": 2, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}."""
    threads, policy, spin = text.split("/")
    unset = lambda v: None if v in ("-", "") else v  # noqa: E731
    return {"setting": text, "threads": int(threads), "OMP_WAIT_POLICY": unset(policy), "GOMP_SPINCOUNT": unset(spin)}  # fmt: skip


def busy_cpu_s() -> tuple[float, float]:
    """CPU seconds since boot that this machine's processes ran, and that the hypervisor stole (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest is already inside user)
    tick = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / tick, v[7] / tick


def wait_until_quiet(max_s: float, cores: float = 0.3, window_s: float = 3.0) -> float:
    """Wait until the machine's processes and the host's steal take under `cores` cores over `window_s` (at most
    `max_s`); the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_s:
        b0 = sum(busy_cpu_s())
        time.sleep(window_s)
        if sum(busy_cpu_s()) - b0 < cores * window_s:
            break
    return time.perf_counter() - t0


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid`."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(args: argparse.Namespace) -> None:
    """Load the model, warm up, time the workload in each phase of `--phases`; print one JSON line."""
    import torch

    from sparserl.engine import RolloutEngine
    from sparserl.models import encode_prompt, load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine = RolloutEngine(model, tokenizer)
    engine.eos_ids = set()
    prompt = encode_prompt(tokenizer, [{"role": "user", "content": PROMPT}])
    engine.generate([prompt], n=args.n, max_new_tokens=8, temperature=1.0, seed=1)  # warm-up
    out: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "prompt_tokens": len(prompt)}
    out["env"] = {k: os.environ.get(k) for k in ENV_KEYS}
    for phase in args.phases.split(","):
        burner = subprocess.Popen([sys.executable, "-c", BURNER]) if phase == "beside" else None
        try:
            if burner is not None:
                time.sleep(1.0)  # the burner is up and busy before the clock starts
            burn0 = proc_cpu_s(burner.pid) if burner else 0.0
            load, (busy0, steal0) = os.getloadavg()[0], busy_cpu_s()
            cpu0, t0 = time.process_time(), time.perf_counter()
            samples = engine.generate([prompt], n=args.n, max_new_tokens=args.tokens, temperature=1.0, seed=0)
            wall, cpu, (busy, steal) = time.perf_counter() - t0, time.process_time() - cpu0, busy_cpu_s()
            busy, steal = busy - busy0, steal - steal0
            burn = proc_cpu_s(burner.pid) - burn0 if burner else 0.0
        finally:  # never leave a burner behind
            if burner is not None:
                burner.kill()
                burner.wait()
        assert sum(len(s.completion_ids) for s in samples) == args.n * args.tokens, "EOS must be ignored"
        out[phase] = {"wall_s": wall, "cpu_s": cpu, "burner_cpu_s": burn, "others_cpu_s": max(busy - cpu - burn, 0.0),
                      "steal_s": steal, "load_avg_1min_before": load}  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)


def run_child(args: argparse.Namespace, setting: dict[str, Any], phases: str) -> dict[str, Any]:
    """One child process under `setting`'s environment; its parsed result."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env.update({k: setting[k] for k in ENV_KEYS if setting[k] is not None})
    cmd = [sys.executable, __file__, "--child", "--threads", str(setting["threads"]), "--phases", phases,
           "--model", args.model, "--n", str(args.n), "--tokens", str(args.tokens)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {setting['setting']} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def previous_runs(
    args: argparse.Namespace,
) -> tuple[dict[tuple[str, int], dict[str, Any]], list[dict[str, Any]]]:
    """For --resume: the undisturbed runs in `--out` by (setting, repeat) when it measured the same workload,
    and its discarded runs, with its disturbed runs added to them (they are measured again)."""
    if not args.out.is_file():
        return {}, []
    old = json.loads(args.out.read_text())
    if [old.get(k) for k in ("model", "n", "tokens")] != [args.model, args.n, args.tokens]:
        return {}, []
    kept, discarded = {}, list(old.get("discarded_runs", []))
    for row in old["rows"]:
        for run in row["runs"]:
            run["disturbed"] = disturbed(run)  # the current rule
            if run["disturbed"]:
                discarded.append({"setting": row["setting"], **run})
            else:
                kept[row["setting"], run["repeat"]] = run
    return kept, discarded


def disturbed(run: dict[str, Any]) -> bool:
    """Whether other processes and the host's steal took more than `DISTURBED` of a core on average during
    either timed call (spinning threads cause some steal themselves: up to 0.13 core measured here)."""
    return any(
        run[p]["others_cpu_s"] + run[p]["steal_s"] > DISTURBED * run[p]["wall_s"] for p in ("alone", "beside")
    )


def summarise(setting: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per phase and the slowdown beside the burner."""
    row = {k: setting[k] for k in ("setting", "threads", *ENV_KEYS)}
    for phase in ("alone", "beside"):
        for key in ("wall_s", "cpu_s", "burner_cpu_s", "others_cpu_s", "steal_s"):
            row[f"{phase}_{key}"] = statistics.median(r[phase][key] for r in runs)
    row["slowdown"] = row["beside_wall_s"] / row["alone_wall_s"]
    row["slowdown_runs"] = [r["beside"]["wall_s"] / r["alone"]["wall_s"] for r in runs]
    row["burner_core_share"] = row["beside_burner_cpu_s"] / row["beside_wall_s"]
    row["disturbed_runs"] = sum(r["disturbed"] for r in runs)
    row["runs"] = runs
    return row


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default=DEFAULT_SETTINGS,
                    help="THREADS/OMP_WAIT_POLICY/GOMP_SPINCOUNT, comma-separated, '-' = unset "
                    f"(default {DEFAULT_SETTINGS})")  # fmt: skip
    ap.add_argument("--chosen", default=DEFAULT_CHOSEN,
                    help=f"the setting the goal is about: the library's default (default {DEFAULT_CHOSEN})")  # fmt: skip
    ap.add_argument("--model", default="smollm2-135m", help="model spec for sparserl.models.load_model")
    ap.add_argument("--n", type=int, default=8, help="samples of the one prompt (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sample, EOS ignored (default 64)")
    ap.add_argument("--repeats", type=int, default=2, help="child runs per setting (default 2)")
    ap.add_argument("--retries", type=int, default=1,
                    help="runs again a child disturbed by other processes or steal (> 0.15 core) up to this often (default 1)")  # fmt: skip
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each child, wait up to this many seconds for the machine to go quiet (default 120)")  # fmt: skip
    ap.add_argument("--resume", action="store_true",
                    help="keep the undisturbed runs already in --out (same model, n, tokens); measure the rest")  # fmt: skip
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 2 settings, 8 tokens, 1 repeat, a temp file"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "shared_cpu.json", help="JSON output")
    ap.add_argument("--child", action="store_true", help="internal: be one measuring child process")
    ap.add_argument("--threads", type=int, default=1, help="internal (--child): torch threads")
    ap.add_argument("--phases", default="alone,beside", help="internal (--child): phases in order")
    return ap.parse_args()


@stoppable("benchmarks/shared_cpu.py", "results not written; run it again", exits=True)
def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.settings, args.tokens, args.repeats = f"1/PASSIVE/-,{args.chosen}", 8, 1
        args.out = Path(tempfile.gettempdir()) / "shared_cpu_quick.json"
    settings = [parse_setting(s) for s in args.settings.split(",")]
    if args.chosen not in [s["setting"] for s in settings]:
        raise SystemExit(f"--chosen {args.chosen} is not among --settings")
    runs: dict[str, list[dict[str, Any]]] = {s["setting"]: [] for s in settings}
    kept, discarded = previous_runs(args) if args.resume else ({}, [])
    for rep in range(args.repeats):
        phases = "alone,beside" if rep % 2 == 0 else "beside,alone"
        for s in settings if rep % 2 == 0 else settings[::-1]:
            if (s["setting"], rep) in kept:
                runs[s["setting"]].append(kept[s["setting"], rep])
                continue
            for attempt in range(args.retries + 1):
                waited = wait_until_quiet(args.quiet_wait)
                r = run_child(args, s, phases)
                r.update(repeat=rep, waited_for_quiet_s=waited, disturbed=disturbed(r))
                if not r["disturbed"] or attempt == args.retries:
                    break
                discarded.append({"setting": s["setting"], **r})
                print(
                    f"repeat {rep} {s['setting']:>14}: disturbed by other processes or steal, run again",
                    flush=True,
                )
            runs[s["setting"]].append(r)
            print(f"repeat {rep} {s['setting']:>14}: alone {r['alone']['wall_s']:.2f} s, beside "
                  f"{r['beside']['wall_s']:.2f} s (others {r['alone']['others_cpu_s']:.1f}/"
                  f"{r['beside']['others_cpu_s']:.1f} CPU-s)", flush=True)  # fmt: skip
    rows = [summarise(s, runs[s["setting"]]) for s in settings]
    info = machine_info()
    cores = info["cores"]
    target = cores / (cores - 1) if cores > 1 else float("inf")
    chosen = next(r for r in rows if r["setting"] == args.chosen)
    goal = f"Beside a one-core burner, the default setting ({args.chosen}) slows down <= {target:.1f}x (one of {cores} cores lost)"  # fmt: skip
    goals = {goal: {"value": chosen["slowdown"], "target": target, "met": chosen["slowdown"] <= target,
                    "command": command_line()}}  # fmt: skip
    print_table(
        ["setting", "alone s", "beside s", "slowdown", "alone CPU s", "beside CPU s", "burner share"],
        [[r["setting"], r["alone_wall_s"], r["beside_wall_s"], r["slowdown"], r["alone_cpu_s"],
          r["beside_cpu_s"], r["burner_core_share"]] for r in rows],
    )  # fmt: skip
    write_json(args.out, {
        "benchmark": "rollout wall time alone and beside a one-core CPU burner, per thread setting",
        "command": command_line(), "model": args.model, "dtype": "float32", "n": args.n, "tokens": args.tokens,
        "repeats": args.repeats, "chosen": args.chosen, "goals": goals,
        "settings_format": "THREADS/OMP_WAIT_POLICY/GOMP_SPINCOUNT, '-' = unset (libgomp: unset policy spins "
        "300000 times, PASSIVE 0; GOMP_SPINCOUNT overrides both)",
        "measured": "wall_s, cpu_s: the timed generate call (CPU of all the child's threads); burner_cpu_s: the "
        "burner's CPU seconds during it; others_cpu_s: every other process's, steal_s: the hypervisor's, from "
        "/proc/stat; medians over repeats. Before each child the parent waits for the machine to go quiet; a "
        "child whose timed calls other processes or steal disturbed (others_cpu_s + steal_s > "
        "disturbed_threshold_cores x wall_s) is run again once (the first run is kept under "
        "discarded_runs); a run still disturbed is kept and counted in disturbed_runs, and --resume measures it "
        "again (the disturbed run moves to discarded_runs)",
        "disturbed_threshold_cores": DISTURBED, "machine": info, "rows": rows, "discarded_runs": discarded,
    })  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
