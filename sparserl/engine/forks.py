"""Forks without a prefill (tree rollouts): a sample continues from another's state at a token it drew.

A request with `snapshots` = k keeps, while it decodes, its state just before each of its k least likely drawn
tokens (the lowest sampler log-probs, the earlier among equals: the tree's fork points, rollout/tree.py): its
cache row (every layer's held slots, per-slot state and page summaries, quantized or not, cut to what it holds),
what the row reads held once (its group's prompt, `HeldPrefix`: not copied into the state) and the next-token
logits. A request started from one (`Request.fork`, its `prefix` the tokens before that position) is admitted
with that row, reading that prompt, and those logits: no prompt or prefix is prefilled again, and under an
evicting cache it holds the slots the parent held there, as an uninterrupted run would. A snapshot is only valid
for the weights that made it.

Under `rollout.kv_memory_cap` the states count against the cap with the rows: a state that does not fit is not
kept, and the scheduler releases states (first those given or kept by a finished sample that no waiting request
starts from, then the largest) before it preempts a running sequence or when nothing else could be admitted.
Either way the state keeps its rank among its sample's least likely tokens, and a child whose state is gone
prefills its prompt and prefix instead: the same draws, at the cost of a prefill. The states a run is given
(made elsewhere: SPEC-RL's drafts at their cuts, engine/draft_states.py) are its KV memory too, from its start to
its end (beyond the cap, released at its start).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sparserl.engine.cache import KVCache
from sparserl.engine.shared_prefix import HeldPrefix, SharedPrefix

if TYPE_CHECKING:
    from sparserl.engine.decoding import DecodeRun


@dataclass
class Snapshot:
    """A sample's state before it drew the token at `position` of its completion (log-prob `logp`): its cache
    row (a one-row cache) and the logits [V] that token was drawn from."""

    position: int
    logp: float
    cache: KVCache | None  # None: released (`release`)
    logits: Tensor | None
    reads: HeldPrefix | None = None  # the input the row read held once (kept alive by the state)
    dense_positions: int = 0  # what the dense engine's state here holds: position (+ prompt unless held once)

    @property
    def held(self) -> bool:
        """Whether its state is held (else only its rank is: not kept, or released, under a KV memory cap)."""
        return self.cache is not None

    @property
    def nbytes(self) -> int:
        """The keys and values of its own row (what it adds to a run's KV memory, beside what it reads)."""
        return self.cache.nbytes() if self.held else 0

    def release(self) -> None:
        """Free its state (for every holder: the run, its backend and the requests given it), keeping its rank."""
        self.cache, self.logits, self.reads = None, None, None


def _rank(s: Snapshot) -> tuple[float, int]:
    return s.logp, s.position


class SnapshotKeeper:
    """The snapshots of a run's samples that ask for them (`wants[i]` per sample), by sample id."""

    def __init__(self, wants: list[int]):
        self.wants = wants
        # per sample: what the dense engine's states hold besides the completion prefix (`extend`)
        self.dense_base = [0] * len(wants)
        self.active = any(wants)
        self.kept: dict[int, list[Snapshot]] = {}  # per sample, its least likely draws so far (held or not)
        # states the run's requests start from that were made elsewhere (SPEC-RL's drafts at their cuts, an
        # earlier run's): held by the run from its start to its end, so charged as its own
        self.given: dict[int, Snapshot] = {}
        self.nbytes = 0  # the keys and values of the snapshots' own rows, counted in the run's peak KV bytes
        self.dense_positions = 0  # the positions the dense engine's snapshots would hold (its yardstick)
        self.read: dict[int, tuple[SharedPrefix, int]] = {}  # id -> an input the states read, and how many do

    def extend(self, wants: list[int], dense_base: list[int]) -> None:
        """The wants of samples added to the run, and the positions the dense engine's states of each hold
        besides their completion prefix (the prompt, unless the dense engine holds it once: its yardstick)."""
        self.wants = [*self.wants, *wants]
        self.dense_base = [*self.dense_base, *dense_base]
        self.active = any(self.wants)

    def observe(
        self,
        cache: KVCache,
        logits: Tensor,
        rows: Tensor,
        ids: Tensor,
        at: Tensor,
        lp: Tensor,
        room: int | None = None,
    ) -> None:
        """One step's draws (before their tokens are fed): keep the state of each draw that is among its
        sample's `wants` least likely so far, dropping the one it displaces; under a KV memory cap only while
        the states fit in `room` more bytes (a state that does not is ranked, not held)."""
        for row, i, t, logp in zip(rows.tolist(), ids.tolist(), at.tolist(), lp.tolist(), strict=True):
            k = self.wants[i]
            if not k:
                continue
            kept = self.kept.setdefault(i, [])
            worst = max(kept, key=_rank) if len(kept) == k else None
            if worst is not None and (logp, t) >= _rank(worst):
                continue
            if worst is not None:
                kept.remove(worst)
                room = None if room is None else room + worst.nbytes
                self._count(worst, -1)
            dense = t + self.dense_base[i]
            if room is not None and cache.row_bytes(row) > room:  # ranked, not held: no room under the cap
                snap = Snapshot(t, logp, None, None, None, dense)
            else:
                snap = Snapshot(
                    t, logp, cache.row_snapshot(row), logits[row].clone(), cache.reading(row), dense
                )
                room = None if room is None else room - snap.nbytes
            self._count(snap, 1)
            kept.append(snap)

    def states(self, i: int) -> list[Snapshot]:
        """The states sample i holds."""
        return [s for s in self.kept.get(i, ()) if s.held]

    def give(self, states: Iterable[Snapshot]) -> None:
        """Take the states requests added to the run start from, those not kept by the run itself (`given`)."""
        mine = {id(s) for kept in self.kept.values() for s in kept}
        for snap in states:
            if snap.held and id(snap) not in mine and id(snap) not in self.given:
                self.given[id(snap)] = snap
                self._count(snap, 1)

    def release_one(self, needed: set[int], finished: set[int]) -> Snapshot | None:
        """Release a held state: first one no waiting request starts from (`needed`: their ids) that was given
        or kept by a finished sample (`finished`: their ids; its children are admitted or belong to a later
        run), else the one with the most bytes (the latest among equals); None when none is held."""
        candidates = [(s, id(s) not in needed) for s in self.given.values() if s.held]
        candidates += [
            (s, id(s) not in needed and i in finished)
            for i, states in self.kept.items()
            for s in states
            if s.held
        ]
        if not candidates:
            return None
        snap, _ = max(candidates, key=lambda c: (c[1], c[0].nbytes, c[0].position))
        self._hold(snap, -1)  # the dense engine's yardstick keeps it: a cap is charged apart (`dense_bytes`)
        snap.release()
        return snap

    def _count(self, snap: Snapshot, sign: int) -> None:
        """Add (sign 1) or take away (-1) a ranked snapshot: its dense positions, and what it holds if held."""
        self.dense_positions += sign * snap.dense_positions
        if snap.held:
            self._hold(snap, sign)

    def _hold(self, snap: Snapshot, sign: int) -> None:
        """Add (sign 1) or take away (-1) a held snapshot's bytes and what it reads."""
        self.nbytes += sign * snap.nbytes
        if snap.reads is not None:
            prefix = snap.reads.prefix
            count = self.read.get(id(prefix), (prefix, 0))[1] + sign
            if count:
                self.read[id(prefix)] = (prefix, count)
            else:
                del self.read[id(prefix)]

    def bytes_beside(self, cache: KVCache) -> int:
        """The keys and values the snapshots hold beyond `cache`: their own rows, and the inputs they read that
        the cache no longer holds."""
        return self.nbytes + sum(p.nbytes() for p, _ in self.read.values() if not cache.holds(p))


def admit_forked(run: DecodeRun, ids: list[int]) -> None:
    """Append the rows of samples started from snapshots (`Request.fork`), with their logits: no prefill."""
    snaps = [run.requests[i].fork for i in ids]
    for i, snap in zip(ids, snaps, strict=True):
        if snap.position != len(run.requests[i].prefix):
            raise ValueError(
                f"request {i}: forked at completion position {snap.position} but given "
                f"{len(run.requests[i].prefix)} prefix tokens"
            )
    need = max(int(s.cache.length[0]) for s in snaps) + 1
    run._resize(max(run.cache.capacity, run.fit_capacity(need)), run.cache.rows + len(ids))
    one = torch.zeros(1, dtype=torch.long, device=run.cache.length.device)
    for snap in snaps:
        run.cache.append(snap.cache, one)
        if snap.reads is not None:
            run.cache.read_from(one + run.cache.rows - 1, snap.reads)
    events = torch.zeros(len(ids), dtype=torch.long, device=run.events.device)
    run._joined(ids, torch.stack([s.logits for s in snaps]), events, 0)
