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
from torch import Tensor

from sparserl.engine.allocation import (
    COMPILED_MIN_ROWS,
    dense_kv_allocation,
    in_blocks,
    own_positions,
    row_bucket,
    running_cache,
)
from sparserl.engine.cache import KVCache
from sparserl.engine.forks import Snapshot, SnapshotKeeper, admit_forked
from sparserl.engine.position_stats import PositionStats
from sparserl.engine.sampling import DistributionRecorder, sample_next, sample_uniforms
from sparserl.engine.shared_prefix import held_once, shared_inputs

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


@dataclass
class Sampling:
    """The processed distribution tokens are drawn from, and the stop strings."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)


class DecodeRun:
    """The running batch of one engine over a fixed list of requests (sample id = index in that list).

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
        self.engine, self.requests, self.sampling, self.recorder = engine, requests, sampling, recorder
        self.kv_memory_cap = kv_memory_cap
        dev, n = engine.decoder.device, len(requests)
        steps = max(r.max_new_tokens for r in requests)
        self.tokens = torch.zeros(n, steps, dtype=torch.long, device=dev)
        self.logps = torch.zeros(n, steps, device=dev)
        self.count = torch.tensor([len(r.prefix) for r in requests], device=dev)  # completion tokens so far
        for i, r in enumerate(requests):
            if r.prefix:
                self.tokens[i, : len(r.prefix)] = torch.tensor(r.prefix, device=dev)
        self.start_count = self.count.clone()
        self.limit = torch.tensor([r.max_new_tokens for r in requests], device=dev)
        # what each sample's first admission prefills: its prompt and the completion tokens it was given
        self.first_input = [tuple(r.prompt) + tuple(r.prefix) for r in requests]
        self.shared = shared_inputs(self.first_input) if engine.share_prompts else set()
        # block-sparse reads: a prompt held once is its whole pages (a row's own pages stay whole pages)
        self.align = engine.sparse.page_size if engine.sparse is not None else 1
        self.prompt_len = torch.tensor([len(r.prompt) for r in requests], device=dev)
        self.longest = max(own_positions(r, self.shared, self.align) for r in requests)
        self.uniforms = torch.cat(
            [sample_uniforms(r.seed, [r.key], steps, dev) for r in requests]
        )  # [n, steps]: each sample's own draws
        self.finish: list[str | None] = [None] * n
        self.events = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = PositionStats(torch.zeros(n, dtype=torch.long, device=dev))
        self.cache = running_cache(engine, bool(self.shared), max(map(len, self.first_input)), self.align)
        self.sample_of_row = torch.zeros(0, dtype=torch.long, device=dev)
        self.logits: Tensor | None = None
        self.compiled = engine.compiled_step is not None
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0, "compress_s": 0.0}
        self.peak_bytes = 0  # the decoding cache's keys and values (what a dense cache is compared with)
        # what the dense engine allocates for these requests (unquantized): the yardstick of the KV memory saved
        self.dense_bytes = dense_kv_allocation(
            requests, self.cache.full_precision_bytes_per_position(), self.compiled, kv_memory_cap
        )
        self.peak_transient_bytes = 0  # with the prefill cache being copied in and storage being reallocated
        self.decode_steps = 0
        self.snapshots = SnapshotKeeper([r.snapshots for r in requests])

    # --------------------------------------------------------------------------------------------- memory

    @property
    def bytes_per_position(self) -> int:
        return self.cache.bytes_per_position()

    def fit_capacity(self, need: int) -> int:
        """Slots per row for rows needing `need` positions: an evicting cache's bound (no row ever holds more);
        else, under a memory cap, blocks of CAPACITY_BUCKET, without one the longest request's whole length
        (prompt + max_new_tokens, allocated once); never more than the longest request can reach. A compiled
        step's capacity is a graph's shape: the longest request's length is rounded up to whole blocks."""
        most = max(need, self.longest)  # no request of the run ever holds more
        if self.compiled:
            most = in_blocks(most)
        if self.engine.evictor is not None:  # copies: the bound from the start, never grown; rows reading a
            # prompt held once: blocks as their own slots grow, up to the bound
            bound = min(most, self.engine.kv.max_budget + self.engine.kv.interval - 1)
            return min(in_blocks(need), bound) if self.shared else bound
        if self.kv_memory_cap is None:  # nothing to share: allocate once (no growth, no copies)
            return most
        return min(in_blocks(need), most)

    def input_length(self, i: int) -> int:
        """Tokens a (re-)admission of sample i prefills: its prompt and the completion tokens it holds."""
        return int(self.prompt_len[i] + self.count[i])

    def shares(self, i: int) -> bool:
        """Whether an admission of sample i reads its first input held once: an input two or more samples start
        from (a group's prompt; a fork point's prompt + prefix; `shared_inputs`), the sample having drawn nothing
        since (a preempted one comes back as a copy), and keeping no fork state nor starting from one."""
        r = self.requests[i]
        own_row = r.snapshots or r.fork is not None  # a snapshot is a whole row; a fork starts from one
        return (
            int(self.count[i]) == int(self.start_count[i])
            and self.first_input[i] in self.shared
            and not own_row
        )

    def own_length(self, i: int, whole: bool = False) -> int:
        """Positions sample i's own row holds once admitted (`whole`: at its end): its input (prompt +
        max_new_tokens), less the part of its first input held once when it reads the shared copy (whole pages
        of it under block-sparse reads)."""
        total = int(self.prompt_len[i] + self.limit[i]) if whole else self.input_length(i)
        return total - held_once(len(self.first_input[i]), self.align) * self.shares(i)

    def shared_bytes_after_admit(self, ids: list[int]) -> int:
        """Bytes of the inputs held once (`SharedPrefixCache`) once `ids` are admitted (evicting: cut first)."""
        new = {self.first_input[i] for i in ids if self.shares(i)}
        held = torch.tensor([len(p) for p in new if self.cache.prefix_id(p) is None], dtype=torch.long)
        if self.engine.evictor is not None:
            held = torch.minimum(held, self.engine.schedule.budget(held))
        return self.cache.shared_bytes() + int(held.sum()) * self.bytes_per_position

    def bytes_after_admit(self, ids: list[int], whole: bool = False) -> int:
        """KV bytes held by the running rows plus `ids`, each charged the capacity the cache would then have
        (`whole`: the capacity their whole length needs, prompt + max_new_tokens)."""
        need = max(self.own_length(i, whole) + (not whole) for i in ids)
        capacity = max(self.cache.capacity, self.fit_capacity(need))
        if self.running:  # and what the running rows need at their next step
            capacity = max(capacity, self.fit_capacity(int(self.cache.length[self._rows()].max()) + 1))
        rows = (self.running + len(ids)) * capacity * self.bytes_per_position
        return rows + self.shared_bytes_after_admit(ids)

    def bytes_next_step(self) -> int:
        """KV bytes the running rows hold after the next step (the cache grows when its longest row fills it)."""
        if not self.running:
            return 0
        capacity = max(self.cache.capacity, self.fit_capacity(int(self.cache.length.max()) + 1))
        return self.running * capacity * self.bytes_per_position + self.cache.shared_bytes()

    def held_bytes(self) -> int:
        """KV bytes charged to the running sequences now (their rows at the current capacity, and the prompts
        held once for their groups)."""
        return self.running * self.cache.capacity * self.bytes_per_position + self.cache.shared_bytes()

    def held_positions(self) -> int:
        """Positions the running sequences' rows actually hold (<= rows x capacity; shared prompts apart)."""
        return int(self.cache.length[self._rows()].sum()) if self.running else 0

    def _resize(self, capacity: int, rows: int) -> None:
        """Grow the cache to `capacity` slots, reserving `rows` rows, or under a cap as many as it affords at
        that size and the unfinished requests can use."""
        reserve = rows
        if self.kv_memory_cap is not None and capacity:
            unfinished = sum(f is None for f in self.finish)
            free = self.kv_memory_cap - self.cache.shared_bytes()
            reserve = max(rows, min(unfinished, free // (capacity * self.bytes_per_position)))
        before = self.cache.nbytes()
        self.cache.resize(capacity, reserve)
        if self.cache.nbytes() != before:  # the old storage is released only once copied
            self.peak_transient_bytes = max(self.peak_transient_bytes, before + self.cache.nbytes())

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
        self.peak_bytes = max(self.peak_bytes, self.cache.nbytes())
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.cache.nbytes() + transient)
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
            self.snapshots.observe(self.cache, self.logits, rows, ids, at, lp)
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
            self.peak_bytes = max(self.peak_bytes, self.cache.nbytes())
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
            bucket = min(bucket, max(n, self.kv_memory_cap // (cache.capacity * self.bytes_per_position)))
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
