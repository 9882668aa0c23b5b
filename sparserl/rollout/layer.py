"""The rollout layer: what the trainer asks for a batch of finished, scored groups.

Per step it takes the groups to run (leftover partial groups first, then new prompts: over-provisioned with
APRIL), runs their unfinished samples through the scheduler under the KV memory cap, scores each group on the
reward worker as soon as its last sample finishes, stops once enough groups are complete (APRIL) and keeps the
rest, tokens, sampler log-probs and versions included, for the next step. Its state (the leftover groups, the
group counter) is part of the checkpoint, so no sample is lost or duplicated across a kill and resume.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sparserl.config.rollout import RolloutConfig
from sparserl.engine.decoding import DecodeRun, Request, Sampling
from sparserl.engine.held import HeldRecord, HeldRecorder
from sparserl.engine.rollout import run_stats
from sparserl.engine.sampling import DistributionRecorder
from sparserl.rollout.records import GroupRecord, SampleRecord
from sparserl.rollout.rewards import RewardWorker
from sparserl.rollout.scheduler import Scheduler


@dataclass
class PromptSource:
    """Where groups come from: `take(k)` draws k task rows (advancing the data position), `prompt_ids(row)`
    its chat-templated tokens, `example(row)` what the reward needs, `score(texts, examples)` the rewards,
    `decode(token lists)` the texts; `max_new_tokens(row, j)`, when set, caps sample j of a row (a scripted
    length mix in benchmarks, a per-prompt budget) instead of `rollout.max_new_tokens`."""

    take: Callable[[int], list[int]]
    prompt_ids: Callable[[int], list[int]]
    example: Callable[[int], Any]
    score: Callable[[list[str], list[Any]], list[float]]
    decode: Callable[[list[list[int]]], list[str]]
    max_new_tokens: Callable[[int, int], int] | None = None  # (row, sample index) -> its cap, else rollout's


@dataclass
class RolloutState:
    """What a checkpoint keeps of the layer: leftover groups (JSON records) and counters."""

    leftover: list[dict[str, Any]] = field(default_factory=list)
    next_group_id: int = 0
    dropped_groups: int = 0


class RolloutLayer:
    """Hands the trainer `collect(version, seed, source)` -> (groups, metrics, ...): `rollout.prompts_per_step`
    complete groups of `rollout.n` scored samples each. The source is passed per call, so that the layer holds
    no reference back to its trainer."""

    def __init__(
        self, engine, cfg: RolloutConfig, record_distributions: dict | None = None, record_held: bool = False
    ):
        """`record_distributions`: the `generate` keywords that record the sampler's distributions (alpha);
        `record_held`: record what an evicting sampler held (`engine.held`, for its teacher-forced replay)."""
        if (record_distributions or record_held) and cfg.partial.enable:
            raise ValueError(
                "recording the sampler's distributions (for alpha) or held positions (for its replay) needs whole "
                "samples; a sample resumed by rollout.partial has lost its earlier ones"
            )
        self.engine, self.cfg = engine, cfg
        self.scheduler = Scheduler(engine, cfg.kv_memory_cap_bytes, cfg.batching)
        self.record = record_distributions or {}
        self.record_held = record_held
        self.state = RolloutState()
        self.rewards = RewardWorker(cfg.async_rewards)

    def close(self) -> None:
        self.rewards.close()

    # ------------------------------------------------------------------------------------------- groups

    def _new_group(self, row: int, seed: int) -> GroupRecord:
        gid, n = self.state.next_group_id, self.cfg.n
        self.state.next_group_id += 1
        # sample j of task row i draws from key i * n + j under this step's seed: its tokens depend on (seed, row,
        # j) and the weights, not on which other prompts share the batch (up to float batch non-invariance)
        samples = [SampleRecord(row, gid, j, seed, row * n + j) for j in range(n)]
        return GroupRecord(gid, row, samples)

    def _groups_for_step(self, version: int, seed: int, source: PromptSource) -> list[GroupRecord]:
        """Leftover groups first (oldest first; those too stale dropped), then new prompts up to the target."""
        p = self.cfg.partial
        want = (
            math.ceil(self.cfg.prompts_per_step * p.over_provision) if p.enable else self.cfg.prompts_per_step
        )
        groups = []
        for g in (GroupRecord.from_dict(d) for d in self.state.leftover):
            oldest = min((s.start_version for s in g.samples if s.tokens), default=version)
            if version - oldest > p.max_staleness:
                self.state.dropped_groups += 1
            else:
                groups.append(g)
        self.state.leftover = []
        fresh = max(0, want - len(groups))
        return groups + [self._new_group(row, seed) for row in source.take(fresh)]

    # ------------------------------------------------------------------------------------------- a step

    def collect(
        self, version: int, seed: int, source: PromptSource
    ) -> tuple[list[GroupRecord], dict[str, float], list]:
        """Run one step's rollouts with the weights of policy `version`, new groups drawing at `seed`; returns
        the complete groups, metrics and, per returned sample, its tokens with what the sampler recorded
        (`completion_ids`, `distributions` for alpha, `held` for an eviction replay: empty unless asked for)."""
        cfg = self.cfg
        groups = self._groups_for_step(version, seed, source)
        pending = [(g, s) for g in groups for s in g.samples if not s.finished]
        cap = source.max_new_tokens or (lambda row, j: cfg.max_new_tokens)
        requests = [
            Request(
                source.prompt_ids(g.prompt_id),
                s.key,
                s.seed,
                cap(g.prompt_id, s.sample_index),
                list(s.tokens),
            )
            for g, s in pending
        ]
        finished_groups = sum(g.finished for g in groups)

        def on_finish(run: DecodeRun, i: int) -> None:
            nonlocal finished_groups
            g, s = pending[i]
            self._append(run, i, s, version)
            s.finish_reason = run.finish[i]
            if g.finished:
                finished_groups += 1
                self._submit(g, source)

        target = cfg.prompts_per_step
        recorder = None
        if self.record and requests:
            recorder = DistributionRecorder.maybe(
                len(requests), max(r.max_new_tokens for r in requests), self.record["top_logprobs"], self.record["full_logprobs"],
                self.engine.decoder.device,
            )  # fmt: skip
        sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k, list(cfg.stop))
        stop = (lambda: finished_groups >= target) if cfg.partial.enable else None
        run, unfinished, sched = None, list(range(len(requests))), None
        held = HeldRecorder() if self.record_held else None
        if requests and not (stop is not None and stop()):  # leftovers may already complete the step
            previous = self.engine.on_step
            self.engine.on_step = held or previous
            try:
                run, unfinished, sched = self.scheduler.run(
                    requests, sampling, on_finish, stop, recorder, seed
                )
            finally:
                self.engine.on_step = previous
        for i in unfinished if run is not None else ():  # stopped early (APRIL): keep what they drew
            self._append(run, i, pending[i][1], version)
        t0 = time.perf_counter()
        rewards = self.rewards.wait()
        reward_wait = time.perf_counter() - t0
        for g in groups:
            if g.group_id in rewards:
                for s, r in zip(g.samples, rewards[g.group_id], strict=True):
                    s.reward = r
        complete = [g for g in groups if g.complete][:target]
        kept = {g.group_id for g in complete}
        self.state.leftover = [g.to_dict() for g in groups if g.group_id not in kept]
        if cfg.partial.mode == "mask_old":
            for g in complete:
                for s in g.samples:
                    s.mask_stale(version)
        distributions = []
        if recorder is not None or held is not None:  # without partial rollouts every sample ran whole here
            holders = [
                _Holder(run.completion(i)[0], held=held.records.get(i) if held else None)
                for i in range(len(pending))
            ]
            if recorder is not None:
                recorder.attach(holders)
            row = {id(s): i for i, (_, s) in enumerate(pending)}
            distributions = [holders[row[id(s)]] for g in complete for s in g.samples]
        metrics = self._metrics(complete, version, run, sched)
        metrics["reward_wait_s"] = reward_wait  # scoring left after decoding ended (the rest overlapped it)
        return complete, metrics, distributions

    def _append(self, run: DecodeRun, i: int, s: SampleRecord, version: int) -> None:
        tokens, logps = run.completion(i)
        if tokens:
            s.extend(tokens, logps.tolist(), version)

    def _submit(self, g: GroupRecord, source: PromptSource) -> None:
        texts = source.decode([s.tokens for s in g.samples])
        self.rewards.submit(g.group_id, source.score, texts, [source.example(g.prompt_id)] * len(g.samples))

    def _metrics(self, groups: list[GroupRecord], version: int, run, sched) -> dict[str, float]:
        samples = [s for g in groups for s in g.samples]
        versions = torch.tensor([v for s in samples for v in s.versions], dtype=torch.float64)
        stale = version - versions
        out = run_stats(run) if run is not None else {}
        if sched is not None:
            out.update(sched.as_metrics())
        out.update(
            {
                "recycled_frac": sum(
                    s.start_version is not None and s.start_version < version for s in samples
                )
                / max(1, len(samples)),
                "staleness_mean": float(stale.mean()) if stale.numel() else 0.0,
                "staleness_max": float(stale.max()) if stale.numel() else 0.0,
                "off_policy_token_frac": float((stale > 0).double().mean()) if stale.numel() else 0.0,
                "partial_buffer_groups": float(len(self.state.leftover)),
                "partial_dropped_groups": float(self.state.dropped_groups),
            }
        )
        return out


@dataclass
class _Holder:
    """A sample's tokens and the distributions they were drawn from, as alpha's measurement reads them."""

    completion_ids: list[int]
    distributions: Any = None
    held: HeldRecord | None = None
