"""Shared benchmark helpers: wall-clock timing, process memory (RSS), machine info, medians and JSON output.

Peak memory is the process's resident set size high-water mark (Linux `VmHWM`). `reset_peak_rss` clears it
(`/proc/self/clear_refs`, Linux >= 4.0) so that several measurements in one process each get their own peak;
where that is not possible the peak is the process-lifetime one (`resource.getrusage`) and
`peak_is_resettable()` says so, so that a report can flag it.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

# the GPU rollout goal: measured by `benchmarks/rollout.py --device cuda`, listed by benchmarks/rl_step.py
GPU_GOAL_TARGET = 2.0  # the dense engine's tokens/s over generate's
GPU_GOAL = (
    f"On a GPU: the dense engine >= {GPU_GOAL_TARGET:g}x transformers' generate tokens/s at batch 64 and 2k-token "
    "generations"
)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Current resident set size of this process, in bytes (0 where it cannot be read)."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size since the last `reset_peak_rss` (or since the process started), in bytes."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc `malloc_trim`), so that the RSS counts live memory only.

    Without it, memory freed by an earlier measurement stays resident in the allocator's pools: the next
    measurement would then reuse it without raising the RSS and look free of cost.
    """
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark to the current RSS; False where the OS does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_is_resettable() -> bool:
    """Whether `reset_peak_rss` works here (else peaks are process-lifetime maxima)."""
    return _status_kib("VmHWM") is not None and reset_peak_rss()


@contextmanager
def measure() -> Iterator[dict[str, float]]:
    """Time a block and record its memory: fills `seconds`, `rss_before_bytes`, `peak_rss_bytes`, `peak_delta_bytes`.

    Freed memory is first returned to the OS; the peak is the RSS high-water mark during the block (reset at
    entry where possible); the delta is the peak minus the RSS at entry: the memory the block itself needed on
    top of what was already resident.
    """
    out: dict[str, float] = {}
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:  # a GPU block: time it to its last kernel, and record its GPU memory high-water mark too
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    release_free_memory()
    reset_peak_rss()
    before = rss_bytes()
    t0 = time.perf_counter()
    try:
        yield out
    finally:
        if cuda:
            torch.cuda.synchronize()
            out["peak_gpu_bytes"] = float(torch.cuda.max_memory_allocated())
        out["seconds"] = time.perf_counter() - t0
        peak = peak_rss_bytes()
        out["rss_before_bytes"] = float(before)
        out["peak_rss_bytes"] = float(peak)
        out["peak_delta_bytes"] = float(max(peak - before, 0))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`fn()`'s result and its wall-clock seconds."""
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def median_of(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Key-wise median of a list of flat numeric dicts (keys of the first run)."""
    return {k: float(statistics.median(r[k] for r in runs)) for k in runs[0]}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: cores, torch threads, CPU, memory, library versions."""
    import transformers

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    mem_kib = None
    try:
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(mem_kib / 2**20, 1) if mem_kib else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def command_line() -> str:
    """The command that produced a result, relative to the repository root when run from it."""
    argv = list(sys.argv)
    with suppress(ValueError):
        argv[0] = str(Path(argv[0]).resolve().relative_to(REPO))
    return "python " + " ".join(shlex.quote(a) for a in argv)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write `payload` as indented JSON (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def update_result(path: str | Path, section: str, payload: dict[str, Any], goals: dict[str, Any]) -> Path:
    """A results file several benchmarks share: replace `section` and these goals, keep the others' (under the
    folder's lock, so that benchmarks writing it at once take turns)."""
    path = Path(path)
    with locked_folder(path):
        old = json.loads(path.read_text()) if path.is_file() else {}
        merged = {
            "goals": {**old.get("goals", {}), **goals},
            **{k: v for k, v in old.items() if k != "goals"},
        }
        merged[section] = payload
        return write_json(path, merged)


def record_result(name: str, section: str, payload: dict[str, Any], goals: dict[str, Any]) -> Path:
    """`update_result` on docs/results/NAME, the machine's description added to the section."""
    return update_result(RESULTS / name, section, {**payload, "machine": machine_info()}, goals)


def mib(n: float) -> float:
    return n / 2**20


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table on stdout (floats to 2 decimals)."""
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


@contextmanager
def locked_folder(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on the folder of `path`, so that processes sharing one results file take
    turns to read, merge and write it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def runs_with_settings(path: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The `runs` of the results file at `path` if it was measured with `settings` (else, or no file: [])."""
    if not path.is_file():
        return []
    old = json.loads(path.read_text())
    return old.get("runs", []) if old.get("settings") == settings else []


def merge_runs_and_write(
    path: Path,
    settings: dict[str, Any],
    mine: list[dict[str, Any]],
    cell: tuple[str, ...],
    resume: bool,
    build: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> dict[str, Any]:
    """Under the folder lock: the runs on disk (when resuming, same settings), with this process's runs
    replacing those of the same cell (the values of the `cell` keys), made into the report by `build(runs)`
    and written atomically, so that processes filling one grid side by side never lose each other's runs."""
    with locked_folder(path):
        kept = runs_with_settings(path, settings) if resume else []
        mine_cells = {tuple(r[k] for k in cell) for r in mine}
        report = build([r for r in kept if tuple(r[k] for k in cell) not in mine_cells] + mine)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, path)
    return report


def timed_rollout(
    model: Any, tokenizer: Any, kv: Any, prompt: list[int], batch: int, length: int, seed: int
) -> tuple[Any, dict[str, float]]:
    """One `generate` call of `batch` samples of `prompt` under the KV policy `kv` (None: dense), at
    temperature 1 with EOS ignored, so that every sample reaches `length` tokens. Returns the rollouts and the
    call's wall and CPU seconds, tokens per CPU second, process memory (peak RSS, its growth over the RSS
    before) and the load averages around it: on a shared machine the wall clock depends on the others' load,
    CPU seconds much less. Each sample holds its own copy of the prompt, as the evicting caches do (and as the
    committed results were measured): benchmarks/brorl.py measures a group's prompt held once."""
    from sparserl.engine import RolloutEngine

    engine = RolloutEngine(model, tokenizer, kv=kv, share_prompts=False)
    engine.eos_ids = set()
    load = os.getloadavg()[0]
    cpu0 = time.process_time()
    with measure() as m:
        out = engine.generate([prompt], n=batch, max_new_tokens=length, temperature=1.0, seed=seed)
    cpu_s = time.process_time() - cpu0
    generated = sum(len(s.completion_ids) for s in out)
    assert generated == batch * length, "EOS must be disabled so that every sample reaches the length"
    return out, {
        "wall_s": m["seconds"],
        "cpu_s": cpu_s,
        "tokens_per_cpu_s": generated / cpu_s if cpu_s > 0 else 0.0,
        "peak_rss_mib": mib(m["peak_rss_bytes"]),
        "peak_growth_mib": mib(m["peak_delta_bytes"]),
        "load_avg_1min_before": load,
        "load_avg_5min_after": os.getloadavg()[1],
    }


class OneBatchUpdates:
    """The default config's first rollout at one thread (its update skipped) and the learner's state before that
    update, so that the learner can update on the same batch again and again from the same start: what an
    update costs under a setting, the rollout apart. `overrides` are added to the default config; a context
    manager (the trainer closed at its end)."""

    def __init__(self, overrides: Sequence[str]):
        import copy
        import tempfile

        from sparserl.config import load_config
        from sparserl.trainer import Trainer

        torch.set_num_threads(1)
        self._tmp = tempfile.TemporaryDirectory()
        cfg = load_config(None, [*overrides, "trainer.steps=1", "trainer.threads=1", "trainer.eval_prompts=0",
                                 f"trainer.output_dir={self._tmp.name}", "logging.progress=false",
                                 "logging.tensorboard=false"])  # fmt: skip
        self.trainer, drawn = Trainer(cfg), []
        self.trainer.learn = lambda step, batch: drawn.append(batch) or {}
        c0 = time.process_time()
        self.trainer.train()  # one rollout and its scoring, the update skipped
        self.rollout_and_score_cpu_s = time.process_time() - c0
        self.batch = drawn[0]
        learner = self.trainer.learner
        self._start = (
            {k: v.clone() for k, v in self.trainer.policy.weights().items()},
            copy.deepcopy(learner.optimizer.state_dict()),
            copy.deepcopy(learner.scheduler.state_dict()),
        )

    def update(self) -> dict[str, float]:
        """The learner's update on the batch from the starting weights, optimizer and schedule: its metrics."""
        weights, optimizer, scheduler = self._start
        learner = self.trainer.learner
        self.trainer.policy.load_weights({k: v.clone() for k, v in weights.items()})
        learner.optimizer.load_state_dict(optimizer)
        learner.scheduler.load_state_dict(scheduler)
        return learner.update(1, self.batch)

    def __enter__(self) -> OneBatchUpdates:
        return self

    def __exit__(self, *exc: object) -> None:
        self.trainer.close()
        self._tmp.cleanup()
