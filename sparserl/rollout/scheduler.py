"""Which sequences decode when: admission under a KV memory cap (continuous or static batching), preemption.

Policy. Every running sequence is charged its cache row: `capacity` slots x the bytes of one position (and a dense
group's prompt, held once for its rows, once). An evicting
cache's rows hold their bound (budget + interval - 1) from the start; dense and block-sparse rows grow in
blocks of 128 positions, all together, as the longest one does (the cache is one [rows, heads, capacity] tensor
per layer, which is what lets attention read it without a gather; a paged layout would charge each sequence
only its own blocks). Continuous batching admits waiting sequences, oldest first, whenever they fit at the
current capacity; when the cache must grow past the cap, the most recently admitted sequences are preempted
(their KV is released, their tokens kept) and wait at the front of the queue, to be re-prefilled (prompt +
tokens so far) when memory frees. Static batching admits only into an empty batch, charging every sequence
its full length (prompt + max_new_tokens), and waits for the whole batch to finish. Fork states
(engine/forks.py) are charged too; they are released (first those no waiting sequence starts from, then the
largest) before any sequence is preempted, and when nothing runs and the next sequence does not fit beside them
(their children prefill instead).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sparserl.config.errors import ConfigError
from sparserl.config.rollout import BATCHING
from sparserl.engine.decoding import DecodeRun, Request, Sampling
from sparserl.engine.sampling import DistributionRecorder
from sparserl.sizes import format_size


@dataclass
class SchedulerStats:
    """One run's scheduling: decode steps, the mean fraction of the cap charged to running sequences
    (occupancy), the mean fraction of their slots actually holding positions (kv_fill), preemptions,
    sequences cut at the cap (a lone sequence outgrowing it) and re-admissions."""

    decode_steps: int = 0
    occupancy_sum: float = 0.0
    fill_sum: float = 0.0
    preemptions: int = 0
    cap_truncated: int = 0
    admissions: int = 0

    def as_metrics(self) -> dict[str, float]:
        steps = max(1, self.decode_steps)
        return {
            "occupancy": self.occupancy_sum / steps,
            "kv_fill": self.fill_sum / steps,
            "preemptions": float(self.preemptions),
            "cap_truncated": float(self.cap_truncated),
            "admissions": float(self.admissions),
            "decode_steps": float(self.decode_steps),
        }


class Scheduler:
    """Runs the engine over a list of requests under `kv_memory_cap` bytes (None: everything at once)."""

    def __init__(self, engine, kv_memory_cap: int | None = None, batching: str = "continuous"):
        if batching not in BATCHING:
            raise ValueError(f"batching={batching!r}: choose one of {', '.join(BATCHING)}")
        self.engine, self.cap, self.batching = engine, kv_memory_cap, batching

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> None:
        """`_check_cap` for one sequence of `prompt_length` prompt tokens, before any run (at start-up)."""
        if self.cap is None:
            return
        request = Request([0] * prompt_length, 0, 0, max_new_tokens)
        self._check_cap(self.engine.start_run([request], Sampling(), kv_memory_cap=self.cap), [0])

    def _check_cap(self, run: DecodeRun, ids: Iterable[int]) -> None:
        """A cap must hold each sequence `ids` alone for its prompt and one step (static: for its whole length);
        a ConfigError naming rollout.kv_memory_cap otherwise (the CLI prints it as one line)."""
        if self.cap is None:
            return
        for i in ids:
            r = run.requests[i]
            need = run.bytes_alone(i, whole=self.batching == "static")
            if need > self.cap:
                held = len(r.prompt) + len(r.prefix)
                raise ConfigError(
                    f"rollout.kv_memory_cap={format_size(self.cap)} is too small for one sequence: a prompt of "
                    f"{held} tokens plus one step needs {format_size(need)} of KV cache (charged "
                    f"{need // run.bytes_per_position} positions of {run.bytes_per_position} bytes); raise the "
                    "cap or unset it"
                )

    def run(
        self,
        requests: list[Request],
        sampling: Sampling,
        on_finish: Callable[[DecodeRun, int], list[Request] | None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        recorder: DistributionRecorder | None = None,
        seed: int = 0,
    ) -> tuple[DecodeRun, list[int], SchedulerStats]:
        """Decode until every request finished or `should_stop()` says so after a step; `on_finish(run, i)` is
        called as each sample finishes, and the requests it returns join the run (`DecodeRun.extend`), queued
        behind the waiting ones (a tree's children, as their parent finishes); `seed` seeds stateful eviction
        (random). Returns the run, the samples stopped unfinished (their tokens so far are in the run) and the
        statistics."""

        def finished(i: int) -> None:
            more = on_finish(run, i) if on_finish is not None else None
            if more:
                ids = run.extend(more)
                self._check_cap(run, ids)
                waiting.extend(ids)

        stats = SchedulerStats()
        with self.engine.decoding():
            run = self.engine.start_run(requests, sampling, recorder, self.cap, seed)
            waiting, running = deque(range(len(requests))), []
            self._check_cap(run, waiting)
            while waiting or run.running:
                self._admit(run, waiting, running, stats)
                if waiting and not run.running:  # never spin: `_check_cap` sized it, maybe with a fork state
                    raise ConfigError(
                        f"rollout.kv_memory_cap={format_size(self.cap)} cannot hold sequence {waiting[0]} alone "
                        "once prefilled (its fork state gave way to the cap); raise the cap"
                    )
                cut = self._preempt(run, waiting, running, stats)
                if cut is not None:
                    finished(cut)
                if not run.running:  # the lone sequence was cut at the cap: admit the next ones
                    continue
                if self.cap is not None:
                    stats.occupancy_sum += run.held_bytes() / self.cap
                stats.fill_sum += run.held_positions() / max(1, run.running * run.cache.capacity)
                stats.decode_steps += 1
                for i in run.step():
                    running.remove(i)
                    finished(i)
                if should_stop is not None and should_stop():
                    break
            unfinished = sorted(running) + sorted(waiting)
            run.retire(running)
        return run, unfinished, stats

    def _admit(self, run: DecodeRun, waiting: deque, running: list, stats: SchedulerStats) -> None:
        if self.batching == "static" and run.running:
            return
        batch: list[int] = []
        while waiting:
            if (
                self.cap is None
                or run.bytes_after_admit(batch + [waiting[0]], whole=self.batching == "static") <= self.cap
            ):
                batch.append(waiting.popleft())
            elif run.running or batch or not run.release_state():  # fork states yield when nothing else runs
                break
        run.admit(batch)
        running.extend(batch)
        stats.admissions += len(batch)

    def _preempt(self, run: DecodeRun, waiting: deque, running: list, stats: SchedulerStats) -> int | None:
        """Release fork states (`RunMemory.release_state`), then the newest sequences, until the next step
        fits; a lone sequence at the cap is cut there (it finishes with reason 'length'; returned)."""
        while self.cap is not None and run.running and run.bytes_next_step() > self.cap:
            if run.release_state():  # a fork state first: its children prefill instead, nothing is lost
                continue
            newest = running.pop()
            if not running:
                run.truncate(newest)
                stats.cap_truncated += 1
                return newest
            run.retire([newest])
            waiting.appendleft(newest)
            stats.preemptions += 1
        return None
