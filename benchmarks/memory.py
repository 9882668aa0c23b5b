"""Where `sparserl train`'s resident memory goes: the default config driven through `Trainer`, with the process's
RSS sampled every 20 ms by a thread and attributed to the phase running (load, engines, evaluation, rollout,
scoring, update, checkpoint, export), and the reward worker processes' RSS read alongside.

    python benchmarks/memory.py                                    # trainer.steps=2 trainer.eval_prompts=8, 1 thread
    python benchmarks/memory.py --out /tmp/mem.json kv.method=dense  # extra key=value overrides
    python benchmarks/memory.py --split --out /tmp/mem.json       # and where the update's bytes go, by kind

Prints one line per phase (entry RSS, peak RSS inside it, exit RSS, MiB) and the process's VmHWM at the end;
with `--record` the numbers go into docs/results/rl_step.json under `memory` and the peak-memory goal.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, machine_info, mib  # noqa: E402

GOAL_NAME = "Peak resident memory of the default `sparserl train` <= 2.5 GB"
GOAL_BYTES = 2.5e9
DEFAULT_OVERRIDES = ["trainer.steps=2", "trainer.threads=1", "trainer.eval_prompts=8"]


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _children_rss() -> int:
    """RSS of this process's live child processes (reward workers), in bytes."""
    import os

    total = 0
    try:
        kids = Path(f"/proc/{os.getpid()}/task").glob("*/children")
        pids = {p for f in kids for p in f.read_text().split()}
    except OSError:
        return 0
    for pid in pids:
        total += _status(pid).get("VmRSS", 0)
    return total


class Probe:
    """A sampling thread: the RSS peak of each phase (entered with `phase(name)`)."""

    def __init__(self) -> None:
        self.current = "start"
        self.phases: dict[str, dict[str, float]] = {}
        self.children_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _note(self) -> None:
        rss = _status().get("VmRSS", 0)
        p = self.phases.setdefault(self.current, {"entry_rss": rss, "peak_rss": rss, "calls": 0})
        p["peak_rss"] = max(p["peak_rss"], rss)
        p["exit_rss"] = rss

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(0.02):
            self._note()
            n += 1
            if n % 10 == 0:
                self.children_peak = max(self.children_peak, _children_rss())

    def phase(self, name: str):
        probe = self

        class _Phase:
            def __enter__(self):
                probe._note()
                self.prev = probe.current
                probe.current = name
                probe._note()
                probe.phases[name]["calls"] += 1

            def __exit__(self, *exc):
                probe._note()
                probe.current = self.prev

        return _Phase()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def wrap(obj: Any, attr: str, probe: Probe, name: str) -> None:
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        with probe.phase(name):
            return fn(*a, **k)

    setattr(obj, attr, wrapped)


def count_packing() -> dict[str, float]:
    """Counts `Decoder.prepare` calls (one per `generate` / decoding run) and the packed-copy builds among them,
    with the builds' CPU seconds and the largest copy's bytes (its distinct storages: each projection [in, out]
    with LoRA merged, and the head): what the weights version saves is (prepares - builds) builds."""
    from sparserl.engine import decoder, weights

    counts = {"prepares": 0, "builds": 0, "build_cpu_s": 0.0, "copy_bytes": 0}
    build, prepare = weights.PackedProjections.build.__func__, decoder.Decoder.prepare

    def counted_build(cls, *a, **k):
        t0 = time.process_time()
        packed = None
        try:
            packed = build(cls, *a, **k)
            return packed
        finally:
            counts["builds"] += 1
            counts["build_cpu_s"] += time.process_time() - t0
            counts["copy_bytes"] = max(counts["copy_bytes"], packed.nbytes() if packed else 0)

    def counted_prepare(self):
        counts["prepares"] += 1
        return prepare(self)

    weights.PackedProjections.build = classmethod(counted_build)
    decoder.Decoder.prepare = counted_prepare
    return counts


MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h): the main heap's size and how much of it is in use or free."""

    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS.split()]


def _heap() -> dict[str, int] | None:
    """The main glibc heap: bytes it spans, in use, and free (held by the allocator, not returned); None where
    the C library is not glibc >= 2.33."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    return {"heap_bytes": m.arena, "heap_in_use_bytes": m.uordblks, "heap_free_bytes": m.fordblks}


def _storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the distinct storages under `tensors`."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def split_update(trainer: Any, update: Any, probe: Probe) -> list[dict[str, Any]]:
    """Wrap the learner's micro-steps: after each micro-batch's forward (its activations all alive, the update's
    peak but for the backward's own tensors), the process's RSS split by kind. Returns the list it fills.
    Inside a decoder layer the learner's own pack hook (trainer/recompute.py) is innermost and hides the saves
    from ours: it shows them to `observing_kept`."""
    import torch

    from sparserl.trainer.recompute import observing_kept

    rows: list[dict[str, Any]] = []
    orig = update.minibatch_updates

    def minibatch_updates(minibatches, grad_accum, optimizer, micro_step, *a, **k):
        module = trainer.policy.module
        params = _storages([*module.parameters(), *module.buffers()])  # the update moves values, not storages

        def measured(micro, finite):
            saved: dict[int, int] = {}

            def pack(t):
                if t.untyped_storage().data_ptr() not in params:
                    saved.update(_storages([t]))
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), observing_kept(pack):
                out = micro_step(micro, finite)
            trained = [p for g in optimizer.param_groups for p in g["params"]]
            state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
            rows.append({
                "rows": len(micro),
                "rss_bytes": _status().get("VmRSS", 0),
                "runtime_bytes": int(probe.phases["imports"]["exit_rss"]),
                "weights_bytes": sum(params.values()),
                "grads_bytes": sum(_storages([p.grad for p in trained if p.grad is not None]).values()),
                "optimizer_state_bytes": sum(_storages(state).values()),
                "activations_bytes": sum(saved.values()),
                **(_heap() or {}),
            })  # fmt: skip
            return out

        return orig(minibatches, grad_accum, optimizer, measured, *a, **k)

    update.minibatch_updates = minibatch_updates
    return rows


def split_summary(rows: list[dict[str, Any]], update_peak: float) -> dict[str, Any]:
    """The micro-batch with the largest RSS after its forward, in MiB by kind: what the rest of the process holds
    (`other`: Python objects, the tokenizer and data, the autograd graph, mapped-but-freed pages) is RSS minus
    the kinds counted; `backward` is the update's peak over that RSS (its gradients of the activations)."""
    top = max(rows, key=lambda r: r["rss_bytes"])
    kinds = ["runtime", "weights", "grads", "optimizer_state", "activations", "heap_free"]
    out = {k: mib(top.get(f"{k}_bytes", 0)) for k in kinds}
    out["other"] = mib(top["rss_bytes"]) - sum(out.values())
    out["rss_after_forward"] = mib(top["rss_bytes"])
    out["backward"] = update_peak - out["rss_after_forward"]
    out["update_peak"] = update_peak
    return out


def print_phases(phases: dict[str, dict[str, float]]) -> None:
    """One line per phase: calls, entry, peak and exit RSS (MiB)."""
    print(f"{'phase':<12}{'calls':>6}{'entry MiB':>11}{'peak MiB':>10}{'exit MiB':>10}")
    for k, v in phases.items():
        print(
            f"{k:<12}{v['calls']:>6}{v['entry_rss']:>11.0f}{v['peak_rss']:>10.0f}{v.get('exit_rss', 0):>10.0f}"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    p.add_argument("--out", default=None, help="also write the measurement here (JSON)")
    p.add_argument("--record", action="store_true", help="record into docs/results/rl_step.json")
    p.add_argument("--split", action="store_true", help="split the update's bytes by kind (split_summary)")
    return p.parse_args()


def main() -> None:
    args = parse_args()

    probe = Probe()
    with probe.phase("imports"):
        from sparserl.config import load_config
        from sparserl.config.model_fit import check_fits_model
        from sparserl.trainer import Trainer, loop, policy, update

    overrides = [*DEFAULT_OVERRIDES, *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*overrides, f"trainer.output_dir={tmp}", "logging.progress=false"])
        check_fits_model(cfg)
        # phases: the policy's load inside the trainer's setup, then the loop's pieces
        wrap(policy, "default_loader", probe, "load_model")
        orig_init = policy.Policy.__init__

        def policy_init(self, *a, **k):
            with probe.phase("policy"):
                orig_init(self, *a, **k)

        policy.Policy.__init__ = policy_init
        packs = count_packing()
        with probe.phase("setup"):
            trainer = Trainer(cfg)
        for attr, name in (("rollout", "rollout"), ("learn", "update"), ("evaluate", "evaluate"),
                           ("save", "checkpoint")):  # fmt: skip
            wrap(trainer, attr, probe, name)
        wrap(trainer.policy, "export", probe, "export")
        wrap(trainer, "_batch", probe, "score")  # inside rollout: dense old / reference log-probs
        wrap(trainer, "_score", probe, "score_fwd")  # one `score` call of the two
        split_rows = split_update(trainer, update, probe) if args.split else None
        del loop, update
        t0 = time.perf_counter()
        with probe.phase("train"):
            summary = trainer.train()
        wall = time.perf_counter() - t0
        trainer.close()
    probe.close()
    status = _status()
    peak = status["VmHWM"]
    phases = {
        k: {kk: (mib(vv) if kk != "calls" else vv) for kk, vv in v.items()} for k, v in probe.phases.items()
    }
    print_phases(phases)
    print(f"packing: {packs}")
    print(f"process peak (VmHWM): {mib(peak):.0f} MiB = {peak / 1e9:.2f} GB; reward workers' peak RSS (sum): "
          f"{mib(probe.children_peak):.0f} MiB; summary peak_rss_bytes: {summary.get('peak_rss_bytes')}")  # fmt: skip
    result = {
        "command": command_line(),
        "overrides": overrides,
        "peak_rss_bytes": peak,
        "reward_workers_peak_rss_bytes": probe.children_peak,
        "phases_mib": phases,
        "train_wall_s": wall,
        "summary_peak_rss_bytes": summary.get("peak_rss_bytes"),
        "rollout_peak_kv_bytes_mean": summary.get("peak_kv_bytes_mean"),
        "steps": trainer.state.step,
        "packing": packs,
        "machine": machine_info(),
    }
    if split_rows:
        result["update_split_mib"] = split_summary(split_rows, phases["update"]["peak_rss"])
        result["update_micro_batches"] = split_rows
        print("update, by kind (MiB):", {k: round(v) for k, v in result["update_split_mib"].items()})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.record:
        path = RESULTS / "rl_step.json"
        data = json.loads(path.read_text())
        data.setdefault("memory", {})["after"] = result
        data["goals"][GOAL_NAME] = {
            "value": peak / 1e9,
            "target": GOAL_BYTES / 1e9,
            "met": peak <= GOAL_BYTES,
            "unit": "GB (10^9 bytes), VmHWM of the training process",
            "command": result["command"],
        }
        path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
