"""One decoding run of the engine: sequences are admitted (prefilled into the running cache) and retired
(finished, preempted or aborted) at any step while the others keep decoding: continuous batching.

`RolloutEngine.generate` admits every request at once and steps until all finish (a static batch); the
rollout layer's scheduler (sparserl/rollout) admits them under a KV memory cap instead. Either way each sample
draws its tokens from its own uniforms, (seed, key, token index), so it does not depend on its batch mates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from sparserl.engine.allocation import (
    COMPILED_MIN_ROWS,
    dense_kv_allocation,
    first_input,
    held_once_inputs,
    own_positions,
    row_bucket,
    running_cache,
)
from sparserl.engine.cache import KVCache
from sparserl.engine.forks import Snapshot, SnapshotKeeper, admit_forked
from sparserl.engine.position_stats import PositionStats
from sparserl.engine.run_memory import RunMemory
from sparserl.engine.sampling import DistributionRecorder, sample_next, sample_uniforms

if TYPE_CHECKING:
    from sparserl.engine.rollout import RolloutEngine


@dataclass
class Request:
    """One sequence to sample: a prompt, and the completion tokens it already has when it is resumed.

    Its tokens are drawn at uniforms that depend only on (`seed`, `key`, the token's index in the completion),
    so a resumed sample continues the stream it started on. `max_new_tokens` counts `prefix` too.
    """

    prompt: list[int]
    key: int
    seed: int
    max_new_tokens: int
    prefix: list[int] = field(default_factory=list)
    snapshots: int = 0  # keep the states before its k least likely tokens (engine/forks.py)
    fork: Snapshot | None = None  # start from this state (its position = len(prefix)): no prefill
    fork_of: tuple[int, int, int] | None = None  # the (seed, key, position) of a state a backend may hold

    def __post_init__(self) -> None:
        if len(self.prefix) >= self.max_new_tokens:
            raise ValueError(
                f"request {self.key}: its {len(self.prefix)} given completion tokens leave nothing to draw under "
                f"max_new_tokens={self.max_new_tokens} (a finished sample is not run again)"
            )


@dataclass
class Sampling:
    """The processed distribution tokens are drawn from, and the stop strings."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)


def _draws(requests: list[Request], steps: int, like: Tensor) -> Tensor:
    """[len(requests), steps] float64: each request's uniforms on its own stream (seed, key), on `like`'s device."""
    none = torch.zeros(0, steps, dtype=torch.float64, device=like.device)
    return torch.cat([none, *(sample_uniforms(r.seed, [r.key], steps, like.device) for r in requests)])


class DecodeRun(RunMemory):
    """The running batch of one engine over a list of requests (sample id = index in it; `extend` adds more).

    `admit(ids)` prefills the requests (identical inputs once: a GRPO group's prompt) and appends their rows;
    `step()` samples one token for every running row, retires those that finished and runs the forward step of
    the rest; `retire(ids)` stops sequences early (preemption, abort) keeping their tokens, so that admitting
    them again re-prefills prompt + tokens so far and continues. Memory: every row holds `cache.capacity` slots:
    an evicting cache's bound, budget + interval - 1; a dense or block-sparse cache, under `kv_memory_cap`,
    blocks of CAPACITY_BUCKET positions that grow as its longest row does, and without a cap the longest
    request's whole length. Under a cap the cache reserves the rows the cap affords at the current capacity (at
    most one per unfinished request), so its keys and values never exceed the cap between steps.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        requests: list[Request],
        sampling: Sampling,
        recorder: DistributionRecorder | None = None,
        kv_memory_cap: int | None = None,
    ):
        self.engine, self.sampling, self.recorder = engine, sampling, recorder
        self.kv_memory_cap = kv_memory_cap
        none = torch.zeros(0, dtype=torch.long, device=engine.decoder.device)
        self.requests: list[Request] = []
        self.first_input: list[tuple[int, ...]] = []  # what each sample's first admission prefills
        self.finish: list[str | None] = []
        self.tokens, self.logps, self.uniforms = none.view(0, 0), none.view(0, 0).float(), _draws([], 0, none)
        self.count = self.start_count = self.limit = self.prompt_len = self.events = none  # per sample
        self.positions = PositionStats(none)
        self.snapshots = SnapshotKeeper([])
        once = held_once_inputs(requests)
        # the inputs the dense engine holds once for these requests: its fork states read their prompt there
        self._dense_once = set() if engine.compiled_step is not None else once
        self._append(requests)
        self.shared = once if engine.share_prompts else set()
        # block-sparse reads: a prompt held once is its whole pages (a row's own pages stay whole pages)
        self.align = engine.sparse.page_size if engine.sparse is not None else 1
        self.longest = max(own_positions(r, self.shared, self.align) for r in requests)
        self.cache = running_cache(engine, bool(self.shared), max(map(len, self.first_input)), self.align)
        self.sample_of_row = none
        self.logits: Tensor | None = None
        self.compiled = engine.compiled_step is not None
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0, "compress_s": 0.0}
        self.peak_bytes = 0  # the decoding cache's keys and values and the fork states kept (engine/forks.py)
        # what the dense engine allocates for these requests' rows (unquantized), and the most its fork states
        # would hold: the yardstick of the KV memory saved (`dense_bytes`)
        self.dense_rows_bytes = dense_kv_allocation(
            requests, self.cache.full_precision_bytes_per_position(), self.compiled, kv_memory_cap
        )
        self.dense_states_peak = 0
        self.peak_transient_bytes = 0  # with the prefill cache being copied in and storage being reallocated
        self.decode_steps = 0
        self.admitted: set[int] = set()  # the samples admitted at least once
        self.fork_prefills = 0  # first admissions of requests naming a fork state they were not given
        self._take_states(requests)

    def _append(self, requests: list[Request]) -> None:
        """Per-sample state of `requests` after the run's (their ids continue the list): tokens so far, limits,
        their own draws (every sample's drawn further when a longer request comes), positions, snapshots."""
        dev, width = self.count.device, self.tokens.shape[1]
        steps = max(width, *(r.max_new_tokens for r in requests))
        if steps > width:
            pad = (0, steps - width)
            self.tokens, self.logps = F.pad(self.tokens, pad), F.pad(self.logps, pad)
            self.uniforms = _draws(self.requests, steps, self.count)
        tokens = torch.zeros(len(requests), steps, dtype=torch.long, device=dev)
        for i, r in enumerate(requests):
            if r.prefix:
                tokens[i, : len(r.prefix)] = torch.tensor(r.prefix, device=dev)
        count = torch.tensor([len(r.prefix) for r in requests], device=dev)
        self.tokens, self.logps = (
            torch.cat([self.tokens, tokens]),
            F.pad(self.logps, (0, 0, 0, len(requests))),
        )
        self.uniforms = torch.cat([self.uniforms, _draws(requests, steps, self.count)])
        self.count, self.start_count = torch.cat([self.count, count]), torch.cat([self.start_count, count])
        self.limit = torch.cat([self.limit, torch.tensor([r.max_new_tokens for r in requests], device=dev)])
        self.prompt_len = torch.cat(
            [self.prompt_len, torch.tensor([len(r.prompt) for r in requests], device=dev)]
        )
        self.events = F.pad(self.events, (0, len(requests)))
        self.requests = [*self.requests, *requests]
        self.first_input += [first_input(r) for r in requests]
        self.finish += [None] * len(requests)
        self.positions.extend(len(requests))
        self.snapshots.extend(
            [r.snapshots for r in requests],
            [len(r.prompt) * (tuple(r.prompt) not in self._dense_once) for r in requests],
        )

    def extend(self, requests: list[Request]) -> list[int]:
        """Add `requests` to the running run (a tree's children as their parents finish); returns their sample
        ids, to admit like the others. The inputs held once stay those of the run's first requests (an added
        request reads one if it starts from it, or if its fork state reads it; else it holds a copy). The
        yardstick's rows become the larger of their own and the dense allocation of the requests unfinished now."""
        if self.recorder is not None:
            raise ValueError(
                "a run recording the sampler's distributions takes all its requests at its start"
            )
        start = len(self.requests)
        self._append(requests)
        self._take_states(requests)
        self.longest = max(self.longest, *(own_positions(r, self.shared, self.align) for r in requests))
        live = [r for r, f in zip(self.requests, self.finish, strict=True) if f is None]
        bpp = self.cache.full_precision_bytes_per_position()
        self.dense_rows_bytes = max(
            self.dense_rows_bytes, dense_kv_allocation(live, bpp, self.compiled, self.kv_memory_cap)
        )
        return list(range(start, len(self.requests)))

    def _take_states(self, requests: list[Request]) -> None:
        """Hold (and charge) the fork states `requests` start from that were made elsewhere (`given`), under a
        KV memory cap only as many as it holds beside the run's storage (the rest released: those requests
        prefill)."""
        self.snapshots.give(r.fork for r in requests if r.fork is not None)
        while self.kv_memory_cap is not None and self.held_kv_bytes() > self.kv_memory_cap:
            if not self.release_state():
                break
        self._note_states()

    def _note_states(self) -> None:
        """The peaks, after the fork states changed: the run's KV bytes and the dense engine's states."""
        self.peak_bytes = max(self.peak_bytes, self.held_kv_bytes())
        dense_states = self.snapshots.dense_positions * self.cache.full_precision_bytes_per_position()
        self.dense_states_peak = max(self.dense_states_peak, dense_states)

    @property
    def dense_bytes(self) -> int:
        """The dense engine's KV bytes for this run: its rows' allocation and the most its fork states hold (its
        states too count against a KV memory cap, which it never exceeds)."""
        total = self.dense_rows_bytes + self.dense_states_peak
        return total if self.kv_memory_cap is None else min(total, self.kv_memory_cap)

    # --------------------------------------------------------------------------------------------- rows

    @property
    def running(self) -> int:
        """Sequences in the batch."""
        return int((self.sample_of_row >= 0).sum())

    def _rows(self) -> Tensor:
        """Cache rows of the running sequences (all of them: finished rows leave the cache at once)."""
        return torch.arange(self.cache.rows, device=self.sample_of_row.device)

    def admit(self, ids: list[int]) -> None:
        """Prefill the given samples (identical inputs once) and add them to the batch; samples that read their
        shared first input (`shares`: a group's prompt) get rows of their own tokens only, that input prefilled
        and held once; samples started from a fork state get its row, nothing prefilled (engine/forks.py)."""
        if not ids:
            return
        t0 = time.perf_counter()
        forked = [
            i for i in ids if self.requests[i].fork is not None and self.count[i] == self.start_count[i]
        ]
        first = [i for i in ids if self.count[i] == self.start_count[i] and i not in self.admitted]
        self.admitted.update(first)
        # named a fork state (tree child, SPEC-RL continuation) but admitted without it: prefilled instead
        self.fork_prefills += sum(self.requests[i].fork_of is not None and i not in forked for i in first)
        copied = [i for i in ids if not self.shares(i) and i not in forked]
        readers = [i for i in ids if self.shares(i)]
        if forked:
            admit_forked(self, forked)
        if copied:
            self._admit_copied(copied)
        if readers:
            self._admit_readers(readers)
        self.timing["prefill_s"] += time.perf_counter() - t0

    def _admit_copied(self, ids: list[int]) -> None:
        """Rows holding their whole input: prefilled (identical inputs once) and copied into each row."""
        dev = self.cache.length.device
        inputs: dict[tuple[int, ...], int] = {}
        source = []
        for i in ids:
            seq = tuple(self.requests[i].prompt) + tuple(self.tokens[i, : int(self.count[i])].tolist())
            source.append(inputs.setdefault(seq, len(inputs)))
        tmp, logits, events = self._prefill([list(seq) for seq in inputs])
        expand = torch.tensor(source, device=dev)
        capacity = max(self.cache.capacity, self.fit_capacity(int(tmp.length.max()) + 1))
        self._resize(capacity, self.cache.rows + len(ids))
        self.cache.append(tmp, expand)
        self._joined(ids, logits[expand], events[expand], tmp.nbytes())

    def _admit_readers(self, ids: list[int]) -> None:
        """Empty rows reading their first input, held once (prefilled now unless a row already reads it)."""
        prompts = [self.first_input[i] for i in ids]
        missing = list(dict.fromkeys(p for p in prompts if self.cache.prefix_id(p) is None))
        transient = 0
        if missing:
            tmp, logits, _ = self._prefill([list(p) for p in missing])
            for row, prompt in enumerate(missing):
                self.cache.hold(prompt, tmp, row, logits[row])
            transient = tmp.nbytes()
        pids = [self.cache.prefix_id(p) for p in prompts]
        need = max(self.own_length(i) for i in ids) + 1
        self._resize(max(self.cache.capacity, self.fit_capacity(need)), self.cache.rows + len(ids))
        self.cache.append_readers(torch.tensor(pids, device=self.cache.length.device))
        # a prefix holding fewer positions than its input was cut after prefill (a compression event)
        held = [self.cache.prefixes[p] for p in pids]
        cut = torch.tensor([int(h.positions < len(p)) for h, p in zip(held, prompts, strict=True)])
        self._joined(ids, torch.stack([h.logits for h in held]), cut.to(self.events.device), transient)

    def _prefill(self, inputs: list[list[int]]) -> tuple[KVCache, Tensor, Tensor]:
        """Distinct inputs prefilled densely into a small cache, cut to the budget by an evicting method (events:
        1 where cut) and summarised for block-sparse reads; returns the cache, next-token logits and events."""
        engine, dev = self.engine, self.cache.length.device
        lengths = torch.tensor([len(p) for p in inputs], device=dev)
        tmp, logits = engine.prefilled(inputs, lengths, self.cache._extra_names)
        events = torch.zeros(len(inputs), dtype=torch.long, device=dev)
        if engine.evictor is not None:
            c0 = time.perf_counter()
            budget = engine.schedule.budget(lengths)
            long_rows = (tmp.length > budget).nonzero().squeeze(-1)
            engine.evictor.compress_to(tmp, long_rows, budget[long_rows], engine.kv.window)
            events[long_rows] += 1
            self.timing["compress_s"] += time.perf_counter() - c0
        if engine.sparse is not None:
            engine.sparse.start(tmp)
        return tmp, logits, events

    def _joined(self, ids: list[int], logits: Tensor, events: Tensor, transient: int) -> None:
        """Bookkeeping once samples `ids` have their rows (the last ones): logits, events, positions, memory
        (`transient`: the prefill cache's bytes, alive while it was copied in)."""
        new = torch.tensor(ids, device=self.sample_of_row.device)
        self.peak_bytes = max(self.peak_bytes, self.held_kv_bytes())
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.held_kv_bytes() + transient)
        self.sample_of_row = torch.cat([self.sample_of_row, new])
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.events[new] += events
        self.positions.start(new, self.cache.held()[-len(ids) :])

    def truncate(self, i: int) -> None:
        """End running sample i now, as if it had reached its length cap."""
        self.finish[i] = "length"
        self.retire([i])

    def retire(self, ids: list[int]) -> None:
        """Take running samples out of the batch (their tokens stay; admitting them again continues them)."""
        if not ids:
            return
        rows = torch.isin(self.sample_of_row, torch.tensor(ids, device=self.sample_of_row.device))
        self._drop(rows.nonzero().squeeze(-1))

    def _drop(self, rows: Tensor) -> Tensor:
        """Remove cache rows; returns each remaining row's former index."""
        order = self.cache.retire(rows)
        self.sample_of_row, self.logits = self.sample_of_row[order], self.logits[order]
        return order

    # --------------------------------------------------------------------------------------------- decoding

    def step(self) -> list[int]:
        """Sample a token for every running sequence; returns the samples that finished with it."""
        engine, kv, s = self.engine, self.engine.kv, self.sampling
        t0 = time.perf_counter()
        rows = self._rows()
        ids = self.sample_of_row[rows]
        at = self.count[ids]
        tok, lp, dist = sample_next(
            self.logits[rows],
            self.uniforms[ids, at],
            s.temperature,
            s.top_p,
            s.top_k,
            self.recorder is not None,
        )
        if self.snapshots.active:  # before the tokens are fed: the state each was drawn in
            self.snapshots.observe(self.cache, self.logits, rows, ids, at, lp, self.state_room())
            self._note_states()
        self.tokens[ids, at], self.logps[ids, at] = tok, lp
        if self.recorder is not None:
            self.recorder.record(at - self.start_count[ids], ids, dist)
        self.count[ids] += 1
        done = self._finished(tok, ids)
        finished = ids[done].tolist()
        if done.any():
            tok = tok[self._drop(rows[done])]  # the rows moved: follow them
            rows = self._rows()
            ids = self.sample_of_row[rows]
        if ids.numel():
            total = self.prompt_len[ids] + self.count[ids] - 1  # the position of the token being fed
            engine.step_budget = engine.schedule.budget(total + 1) if kv.sparse else None
            if engine.evictor is not None and bool((self.count[ids] % kv.interval == 0).any()):
                self._compress(rows, ids)
            need = int(self.cache.length[rows].max()) + 1
            if need > self.cache.capacity:
                self._resize(self.fit_capacity(need), self.cache.rows)
            if engine.compiled_step is None or self.cache.rows < COMPILED_MIN_ROWS:
                self.logits = engine._decode_step(tok, total, self.cache)
            else:
                self.logits = self._compiled_step(tok, total)
            held = self.cache.held()[rows]
            read = engine.sparse.plan.read[rows] if engine.sparse is not None else held
            self.positions.add(ids, held, read, total + 1)
            self.peak_bytes = max(self.peak_bytes, self.held_kv_bytes())
            self.peak_transient_bytes = max(self.peak_transient_bytes, self.peak_bytes)
            self.decode_steps += 1
            for hook in engine.step_hooks:
                hook(self.decode_steps - 1, self.cache, self.sample_of_row)
        self.timing["decode_s"] += time.perf_counter() - t0
        return finished

    def _compiled_step(self, tok: Tensor, total: Tensor) -> Tensor:
        """The compiled decode step over the live rows padded to a bucket of rows (`row_bucket`; under a memory
        cap never more than the cap affords at this capacity), attending over the whole capacity: the graph's
        shape is (bucket, capacity), so a handful of graphs serve every batch. Padding rows are reserved storage
        (counted against the cap; an admission overwrites all of a row): they decode token 0 at position 0 from
        an emptied row, unread."""
        cache, n = self.cache, self.cache.rows
        bucket = row_bucket(n)
        if self.kv_memory_cap is not None:  # no more rows than the cap affords at this capacity
            bucket = min(bucket, max(n, self.rows_room() // (cache.capacity * self.bytes_per_position)))
        cache.reserve_rows(bucket)
        feed = torch.zeros(bucket, dtype=torch.long, device=tok.device)
        pos = torch.zeros(bucket, dtype=total.dtype, device=tok.device)
        feed[:n], pos[:n] = tok, total
        budget = self.engine.step_budget  # block_topk: the padding rows read under the first row's budget
        if budget is not None and bucket > n:
            self.engine.step_budget = torch.cat([budget, budget[:1].expand(bucket - n)])
        with cache.padded(bucket):
            cache.length[n:] = 0
            if self.engine.cuda_graphs:
                cache.mark_static_addresses()
            self.engine.note_compile(bucket, cache.capacity)
            logits = self.engine.compiled_step(feed, pos, cache, cache.capacity)
            self.engine.note_compiled()
        self.engine.step_budget = budget
        return logits[:n].clone() if self.engine.cuda_graphs else logits[:n]

    def _compress(self, rows: Tensor, ids: Tensor) -> None:
        """Cut the rows due this step (every `interval` tokens of their own) that hold their budget or more."""
        engine = self.engine
        c0 = time.perf_counter()
        due = self.count[ids] % engine.kv.interval == 0  # counted over the whole completion, resumed or not
        over = due & (self.cache.held()[rows] >= engine.step_budget)
        picked = over.nonzero().squeeze(-1)
        engine.evictor.compress_to(
            self.cache, rows[picked], engine.step_budget[picked] - 1, engine.kv.window - 1
        )
        self.events[ids[picked]] += 1
        self.timing["compress_s"] += time.perf_counter() - c0

    def _finished(self, tok: Tensor, ids: Tensor) -> Tensor:
        """Rows whose new token is an EOS, completes a stop string, or reaches the sample's length cap."""
        engine, stop = self.engine, self.sampling.stop
        done = torch.zeros_like(tok, dtype=torch.bool)
        if engine.eos_ids:
            done |= torch.isin(tok, torch.tensor(sorted(engine.eos_ids), device=tok.device))
        if stop:
            # tokens that may spell a stop string: one per UTF-8 byte at most (a character can be several
            # tokens: a byte-level tokenizer spells a CJK character in three), plus two for the edges
            tail = max(len(x.encode("utf-8")) for x in stop) + 2
            for r, sample in enumerate(ids.tolist()):
                if not done[r]:
                    end = int(self.count[sample])
                    text = engine.tokenizer.decode(self.tokens[sample, max(0, end - tail) : end].tolist())
                    done[r] = any(x in text for x in stop)
        for r in done.nonzero().squeeze(-1).tolist():
            self.finish[int(ids[r])] = "stop"
        capped = ~done & (self.count[ids] >= self.limit[ids])
        for r in capped.nonzero().squeeze(-1).tolist():
            self.finish[int(ids[r])] = "length"
        return done | capped

    def completion(self, i: int) -> tuple[list[int], Tensor]:
        """Sample i's tokens generated in this run and their sampler log-probs (its prefix excluded)."""
        a, b = int(self.start_count[i]), int(self.count[i])
        return self.tokens[i, a:b].tolist(), self.logps[i, a:b].float().cpu()
