"""Which machine each reuse v2 run trained on (docs/results/reuse_v2/parts/machines.json), and the finished runs
copied back to main. The runs train from a worktree frozen at the first run's code (experiments/reuse_v2.py),
and the machine changes between sessions: a speed pair compares only runs that trained wholly on one machine
(the rule `machines` in docs/results/reuse_v2.json).

    python experiments/reuse_v2_machines.py ../reuse_v2_code   # at each session's start, then after each run

Each call adds this machine (CPU model and boot id: one session) to every run in progress in the worktree and
every finished one not listed yet; a run resumed on a new machine lists both. It then copies each finished run's
parts (curves and held-out) into this checkout and prints the `git add` of the new ones.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from study import write_with_goals

ROOT = Path(__file__).resolve().parent.parent
PARTS = Path("docs/results/reuse_v2/parts")
MACHINES = ROOT / PARTS / "machines.json"
EARLIER = "an earlier session's machine (not recorded)"


def this_machine() -> str:
    """'<CPU model> (boot <id>)': the boot id tells two sessions on the same CPU model apart."""
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        "unknown CPU",
    )  # fmt: skip
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    return f"{model} (boot {boot})"


def load_machines() -> dict[str, list[str]]:
    """Run name -> the machines it trained on, in order (empty before any run)."""
    return json.loads(MACHINES.read_text())["runs"] if MACHINES.is_file() else {}


def save_machines(machines: dict[str, list[str]]) -> None:
    """The record, with an empty goals mapping: the goals it bears on are judged in reuse_v2.json."""
    body = {
        "judged_in": "docs/results/reuse_v2.json (the rule `machines`)",
        "runs": dict(sorted(machines.items())),
    }
    write_with_goals(MACHINES, body, {})


def note(machines: dict[str, list[str]], names: list[str], machine: str) -> None:
    """Add `machine` to each of `names` whose list does not end with it."""
    for name in names:
        if machines.get(name, [])[-1:] != [machine]:
            machines[name] = [*machines.get(name, []), machine]


def one_machine(machines: dict[str, list[str]], *names: str) -> bool:
    """True when every run of `names` trained wholly on one and the same machine."""
    lists = [machines.get(n, []) for n in names]
    return all(len(m) == 1 for m in lists) and len({m[0] for m in lists}) == 1


def sync(worktree: Path) -> list[Path]:
    """Note this machine on the worktree's runs in progress and finished ones, then copy the finished runs'
    parts here; the files copied."""
    machines = load_machines()
    runs = worktree / "runs" / "reuse_v2"
    started = [d.name for d in sorted(runs.iterdir()) if d.is_dir()] if runs.is_dir() else []
    finished = [p.stem for p in sorted((worktree / PARTS / "eval").glob("*.json"))]
    unlisted = [n for n in finished if n not in machines]
    in_progress = [n for n in started if n not in finished]
    booted = next(
        int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime")
    )
    older = [n for n in in_progress if n not in machines and (runs / n).stat().st_mtime < booted]
    note(machines, older, EARLIER)  # a run directory that outlived its machine
    note(machines, [*in_progress, *unlisted], this_machine())
    save_machines(machines)
    copied = []
    for name in finished:
        for kind in ("curves", "eval"):
            src, dst = worktree / PARTS / kind / f"{name}.json", ROOT / PARTS / kind / f"{name}.json"
            if src.is_file() and (not dst.is_file() or dst.read_bytes() != src.read_bytes()):
                shutil.copyfile(src, dst)
                copied.append(dst)
    return copied


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit(__doc__)
    new = sync(Path(sys.argv[1]))
    print(f"git add {MACHINES.relative_to(ROOT)} {' '.join(str(p.relative_to(ROOT)) for p in new)}")
