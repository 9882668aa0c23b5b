"""What a decoding run's rows hold, and would hold after an admission or a step: the accounting the scheduler
admits and preempts by (rollout/scheduler.py), and the cache's growth. A mixin of `DecodeRun`, which keeps the
per-sample state it reads (prompt lengths, counts, limits, first inputs and those held once)."""

from __future__ import annotations

import torch

from sparserl.engine.allocation import in_blocks, read_once
from sparserl.engine.shared_prefix import held_once


class RunMemory:
    """KV bytes and slots of a `DecodeRun`'s rows (see its docstring for the policy)."""

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

    def reads(self, i: int) -> tuple[int, ...] | None:
        """The input an admission of sample i reads held once (`read_once`: a group's prompt, or the prompt its
        fork state reads), the sample having drawn nothing since (a preempted one comes back as a copy)."""
        fresh = int(self.count[i]) == int(self.start_count[i])
        return read_once(self.requests[i], self.shared) if fresh else None

    def shares(self, i: int) -> bool:
        """Whether an admission of sample i is an empty row reading its first input held once (not a fork)."""
        return self.requests[i].fork is None and self.reads(i) is not None

    def own_length(self, i: int, whole: bool = False) -> int:
        """Positions sample i's own row holds once admitted (`whole`: at its end): its input (prompt +
        max_new_tokens), less what it reads held once (whole pages of it under block-sparse reads)."""
        total = int(self.prompt_len[i] + self.limit[i]) if whole else self.input_length(i)
        read = self.reads(i)
        return total - (held_once(len(read), self.align) if read else 0)

    def shared_bytes_after_admit(self, ids: list[int]) -> int:
        """Bytes of the inputs held once (`SharedPrefixCache`) once `ids` are admitted (evicting: cut first)."""
        new = {read for i in ids if (read := self.reads(i))}
        return self.cache.shared_bytes() + self._held_once_bytes(
            [p for p in new if self.cache.prefix_id(p) is None]
        )

    def _held_once_bytes(self, inputs: list[tuple[int, ...]]) -> int:
        """Bytes of `inputs` held once (an evicting cache holds each cut to its budget)."""
        held = torch.tensor([len(p) for p in inputs], dtype=torch.long)
        if self.engine.evictor is not None:
            held = torch.minimum(held, self.engine.schedule.budget(held))
        return int(held.sum()) * self.bytes_per_position

    def bytes_alone(self, i: int, whole: bool = False) -> int:
        """KV bytes sample i holds admitted alone into an empty run for its input and one step (`whole`: for its
        whole length): what a KV memory cap must afford it (`bytes_after_admit([i])` of a run holding nothing)."""
        need = self.own_length(i, whole) + (not whole)
        alone = self.fit_capacity(need) * self.bytes_per_position
        return alone + self._held_once_bytes([read] if (read := self.reads(i)) else [])

    def bytes_after_admit(self, ids: list[int], whole: bool = False) -> int:
        """KV bytes held by the running rows plus `ids`, each charged the capacity the cache would then have
        (`whole`: the capacity their whole length needs, prompt + max_new_tokens)."""
        need = max(self.own_length(i, whole) + (not whole) for i in ids)
        capacity = max(self.cache.capacity, self.fit_capacity(need))
        if self.running:  # and what the running rows need at their next step
            capacity = max(capacity, self.fit_capacity(int(self.cache.length[self._rows()].max()) + 1))
        rows = (self.running + len(ids)) * capacity * self.bytes_per_position
        return rows + self.shared_bytes_after_admit(ids) + self.states_bytes()

    def bytes_next_step(self) -> int:
        """KV bytes the running rows hold after the next step (the cache grows when its longest row fills it)."""
        if not self.running:
            return 0
        capacity = max(self.cache.capacity, self.fit_capacity(int(self.cache.length.max()) + 1))
        rows = self.running * capacity * self.bytes_per_position
        return rows + self.cache.shared_bytes() + self.states_bytes()

    def held_bytes(self) -> int:
        """KV bytes charged now: the running sequences' rows at the current capacity, the prompts held once for
        their groups, and the fork states kept (engine/forks.py)."""
        rows = self.running * self.cache.capacity * self.bytes_per_position
        return rows + self.cache.shared_bytes() + self.states_bytes()

    def states_bytes(self) -> int:
        """KV bytes of the fork states the run keeps, beyond what its cache holds (engine/forks.py)."""
        return self.snapshots.bytes_beside(self.cache)

    def state_room(self) -> int | None:
        """Bytes a new fork state may take under the KV memory cap: what the cache's storage and the states
        leave free (None without a cap)."""
        return None if self.kv_memory_cap is None else self.kv_memory_cap - self.held_kv_bytes()

    def release_state(self) -> bool:
        """Free a fork state (under the cap, before a sequence is preempted for memory: `release_one`); the
        requests not yet admitted from it will prefill instead. False when none is held."""
        running = set(self.sample_of_row.tolist())
        waiting = [
            r for i, r in enumerate(self.requests)
            if self.finish[i] is None and i not in running and int(self.count[i]) == int(self.start_count[i])
        ]  # fmt: skip
        finished = {i for i, f in enumerate(self.finish) if f is not None}
        snap = self.snapshots.release_one({id(r.fork) for r in waiting if r.fork is not None}, finished)
        if snap is None:
            return False
        for r in self.requests:
            if r.fork is snap:
                r.fork = None
        return True

    def rows_room(self) -> int:
        """Bytes of the KV memory cap left for rows: less the prompts held once and the fork states."""
        return self.kv_memory_cap - self.cache.shared_bytes() - self.states_bytes()

    def held_positions(self) -> int:
        """Positions the running sequences' rows actually hold (<= rows x capacity; shared prompts apart)."""
        return int(self.cache.length[self._rows()].sum()) if self.running else 0

    def _resize(self, capacity: int, rows: int) -> None:
        """Grow the cache to `capacity` slots, reserving `rows` rows, or under a cap as many as it affords at
        that size and the unfinished requests can use."""
        reserve = rows
        if self.kv_memory_cap is not None and capacity:
            unfinished = sum(f is None for f in self.finish)
            reserve = max(rows, min(unfinished, self.rows_room() // (capacity * self.bytes_per_position)))
        before = self.cache.nbytes()
        self.cache.resize(capacity, reserve)
        if self.cache.nbytes() != before:  # the old storage is released only once copied
            self.peak_transient_bytes = max(self.peak_transient_bytes, before + self.held_kv_bytes())

    def held_kv_bytes(self) -> int:
        """Keys and values the run holds now: its cache's storage and the fork states its samples keep."""
        return self.cache.nbytes() + self.states_bytes()
