"""A process's peak resident memory. The trainer asks it of itself and of every Ray actor it started (rollout
workers, learner ranks), which answer for their own process, so a run's summary counts each process that holds
a copy of the model, not only the driver."""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes: Linux's VmHWM, else getrusage's ru_maxrss (a
    resumed run reports its own session's; child processes, such as reward workers, are not included)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # POSIX only; Linux answered above

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def actor_peaks(ray: Any, actors: list[Any], label: str, timeout_s: float = 30.0) -> dict[str, int]:
    """'{label} {i}' -> the peak RSS that Ray actor i reports of its own process (its `peak_rss` method); an
    actor that died or does not answer within `timeout_s` is left out."""
    refs = [actor.peak_rss.remote() for actor in actors]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    peaks = {}
    for i, ref in enumerate(refs):
        if ref in done:
            with contextlib.suppress(Exception):  # the actor died: its peak is gone with it
                peaks[f"{label} {i}"] = int(ray.get(ref))
    return peaks
