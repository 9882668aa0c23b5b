"""The rollout layer: from a step's group plans to finished, scored groups.

It turns the plans of a group source into sample records, hands their unfinished samples to a rollout
backend as plain requests, appends the segments the backend returns, scores each group on the reward worker
as soon as its last sample finishes, and, with partial rollouts (APRIL), has the backend stop once enough
groups are complete; the groups not trained on go back to the source, tokens, sampler log-probs and versions
included. It holds only plain values between steps (the group counter), saved in the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparserl.config.rollout import RolloutConfig
from sparserl.engine.decoding import Request, Sampling
from sparserl.rollout.backend import RolloutBackend, Segment, merge_run_metrics
from sparserl.rollout.records import GroupRecord, SampleRecord
from sparserl.rollout.reuse import accepted_length, verification_uniforms
from sparserl.rollout.sources import Draft, GroupPlan, GroupSource
from sparserl.rollout.task_view import TaskView

SPEC_COUNTS = (
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_whole_drafts",
    "spec_verify_s",
)


@dataclass
class RolloutState:
    """What a checkpoint keeps of the layer."""

    next_group_id: int = 0


@dataclass
class Collected:
    """One step's rollouts: the `groups` to train on (complete, scored), the `leftover` ones (unfinished or
    beyond the target), the run's `metrics`, and per trained sample the segments' recordings (`recorded`:
    distributions for alpha, held positions for a replay; empty unless asked for)."""

    groups: list[GroupRecord]
    leftover: list[GroupRecord]
    metrics: dict[str, float]
    recorded: list[Segment] = field(default_factory=list)
    sampling: dict[str, float] = field(default_factory=dict)  # collect_step: what its rounds cost and gave
    by_sample: dict[int, Segment] = field(default_factory=dict)  # recordings by id(SampleRecord)
    task_counters: dict[str, float] = field(default_factory=dict)  # the task's reward calls, errors, timeouts
    logged: dict[str, float] = field(default_factory=dict)  # what the reward functions logged (log_metric)
    ref_logps: torch.Tensor | None = None  # [B, T] the reference's log-probs, when scored beside the rollout


class RolloutLayer:
    """`collect(version, plans)` -> `Collected`: `rollout.prompts_per_step` complete groups of scored samples.
    `backend` runs the samples, `task` gives prompts and rewards; the plans come from a group source, and
    the groups go back to it (`Collected.groups`, `Collected.leftover`)."""

    def __init__(
        self, backend: RolloutBackend, task: TaskView, cfg: RolloutConfig, max_extra_rounds: int = 0
    ) -> None:
        if backend.recording.any and cfg.partial.enable:
            raise ValueError(
                "recording the sampler's distributions (for alpha, the keep-sampling mask) or held positions (for "
                "its replay) needs whole samples; a sample resumed by rollout.partial has lost its earlier ones"
            )
        if backend.recording.held and cfg.kv_memory_cap_bytes is not None:
            raise ValueError(
                "recording held positions (DistillSparse's replay of an evicting sampler) cannot be combined with "
                "rollout.kv_memory_cap: a preempted sample is re-prefilled, which the replay cannot reproduce"
            )
        self.backend, self.task, self.cfg = backend, task, cfg
        self.max_extra_rounds = max_extra_rounds  # sampling.max_extra_rounds: rounds after a step's first
        self.spec_counts = dict.fromkeys(SPEC_COUNTS, 0)  # this step's draft verifications (SPEC-RL)
        self.state = RolloutState()
        self.rewards = backend.reward_worker(task, cfg.async_rewards)

    def close(self) -> None:
        self.rewards.close()
        self.backend.close()

    def _group(self, plan: GroupPlan, version: int) -> GroupRecord:
        """The plan's record: the group it resumes or extends, or a new one with its own id and streams (its
        samples started from their verified drafts, when the plan has drafts)."""
        if plan.resume is not None:
            return plan.resume
        if plan.extends is not None:  # more samples for a group already drawn (DARS's second round, a tree)
            g = plan.extends
            start = len(g.samples)
            new = [
                SampleRecord(plan.row, g.group_id, start + j, plan.seed, key, snapshots=plan.snapshots)
                for j, key in enumerate(plan.keys)
            ]
            g.samples += new
            if plan.drafts is not None:
                self._start_from_drafts(plan.row, new, plan.drafts, version)
            return g
        gid = self.state.next_group_id
        self.state.next_group_id += 1
        caps = plan.max_new_tokens or [None] * plan.n
        samples = [
            SampleRecord(plan.row, gid, j, plan.seed, key, max_new_tokens=cap, snapshots=plan.snapshots)
            for j, (key, cap) in enumerate(zip(plan.keys, caps, strict=True))
        ]
        if plan.drafts is not None:
            self._start_from_drafts(plan.row, samples, plan.drafts, version)
        return GroupRecord(gid, plan.row, samples)

    def _start_from_drafts(
        self, row: int, samples: list[SampleRecord], drafts: list[Draft | None], version: int
    ) -> None:
        """Start samples from their drafts (sources.Draft says which part is kept and with which sampler
        log-probs; SPEC-RL's test in rollout/reuse.py): the kept tokens are drawn by no one now
        (`reused_prefix`); a sample is finished if its whole draft and its end were kept."""
        todo = [
            (s, d)
            for s, d in zip(samples, drafts, strict=True)
            if d is not None and (d.tokens or d.finish or d.fork_of)
        ]
        prompt = self.task.prompt_ids(row)
        t0 = time.perf_counter()
        coupled = [(s, d) for s, d in todo if d.stream is not None and d.tokens]
        redrawn = self.backend.redraw(
            [prompt] * len(coupled), [d.tokens for _, d in coupled], [d.stream for _, d in coupled],
            self.cfg.sampling_temperature, self.cfg.spec.verify == "batched",
        ) if coupled else []  # fmt: skip
        scored = [(s, d) for s, d in todo if d.stream is None and d.tokens and (d.logps is None or d.verify)]
        now = self.backend.score([prompt] * len(scored), [d.tokens for _, d in scored], self.cfg.temperature)
        self.spec_counts["spec_verify_s"] += time.perf_counter() - t0
        verified = {id(s): lp for (s, _), lp in zip(scored, now, strict=True)}
        verified |= {id(s): r for (s, _), r in zip(coupled, redrawn, strict=True)}
        for s, d in todo:
            cut, logps = self._kept(s, d, verified.get(id(s)))
            fork_of = d.fork_of
            # the sample goes on on the draft's stream, from its state at the cut when the backend kept it
            if d.stream is not None:
                s.seed, s.key = d.stream
                fork_of = (*d.stream, cut)
            s.extend(d.tokens[:cut], logps[:cut], version)
            s.reused_prefix, s.prefix_origin, s.fork_of = cut, d.origin, fork_of
            whole = cut == len(d.tokens) and d.finish is not None
            if whole or cut == (s.max_new_tokens or self.cfg.max_new_tokens):
                s.finish_reason = d.finish if whole else "length"

    def _kept(
        self, s: SampleRecord, d: Draft, verified: list[float] | tuple[int, list[float]] | None
    ) -> tuple[int, list[float]]:
        """How many of the draft's tokens sample `s` keeps, and their sampler log-probs (`verified`: the
        verifier's log-probs, or a coupled draft's (cut, log-probs))."""
        cap, spec = s.max_new_tokens or self.cfg.max_new_tokens, self.cfg.spec
        if d.stream is not None:
            cut, logp_now = verified if d.tokens else (0, [])
            cut = min(cap, cut)
        elif d.logps is None or not d.verify:
            return min(cap, len(d.tokens)), d.logps if d.logps is not None else verified or []
        else:
            logp_now = verified
            uniforms = verification_uniforms(s.seed, s.key, len(d.tokens))
            cut = min(cap, accepted_length(logp_now, d.logps, uniforms, spec.lenience))
        c = self.spec_counts
        c["spec_drafts"] += 1
        c["spec_draft_tokens"] += len(d.tokens)
        c["spec_accepted_tokens"] += cut
        c["spec_whole_drafts"] += cut == len(d.tokens) and d.finish is not None
        return cut, logp_now if spec.prefix_logp == "verifier" or d.logps is None else d.logps

    def _request(self, s: SampleRecord) -> Request:
        cap = s.max_new_tokens or self.cfg.max_new_tokens
        fork_of = (
            s.fork_of if s.fork_of is not None and len(s.tokens) == s.fork_of[2] else None
        )  # not resumed
        return Request(self.task.prompt_ids(s.prompt_id), s.key, s.seed, cap, list(s.tokens), s.snapshots,
                       fork_of=fork_of)  # fmt: skip

    def collect_step(
        self, source: GroupSource, k: int, version: int, seed: int, drawn_by: int | None = None
    ) -> Collected:
        """One step: the source's plans for `k` groups, then after each round its refills (at most
        `max_extra_rounds` more rounds, none with partial rollouts), its choice of the groups to train on;
        the groups go back to it (`observe`). `Collected.sampling` says what the rounds cost and gave.

        `version` is the policy that will train on the step (the source plans for it; staleness is measured
        against it); `drawn_by` the weights the backend holds and samples with, older when the rollout runs
        ahead of the update (rollout.overlap), else the same."""
        drawn_by = version if drawn_by is None else drawn_by
        self.task.step = version  # the updates done: what reward functions see as trainer_state.global_step
        self.spec_counts = dict.fromkeys(SPEC_COUNTS, 0)
        t_rounds = time.perf_counter()
        grow = source.grow if self.backend.grows_runs else None  # a tree's children join their parent's run
        first = self.collect(drawn_by, seed, source.plan(k, version), grow=grow)
        scored, rounds = list(first.groups), [first]
        first_flat = _zero_variance_frac(first.groups)  # before a later round extends these groups
        while len(rounds) <= self.max_extra_rounds and (plans := source.refill(scored, k, version)):
            more = self.collect(drawn_by, seed, plans, target=len(plans), grow=grow)
            rounds.append(more)
            scored += [g for g in more.groups if all(g is not h for h in scored)]
        trained = source.select(scored, k)
        t0 = time.perf_counter()
        rounds_s = t0 - t_rounds
        if source.needs_scores:
            self._score_samples(trained, drawn_by)
        score_s = time.perf_counter() - t0
        source.observe(trained, first.leftover)
        segments = {i: seg for r in rounds for i, seg in r.by_sample.items()}
        recorded = [segments.get(id(s)) for g in trained for s in g.samples] if segments else []
        if None in recorded:
            raise ValueError(
                "recording the sampler (trainer.log_acceptance, distill.enable) needs every trained sample decoded "
                "whole in one round; this step's source gave samples started from others (a second round, a "
                "tree, shared or reused samples): turn one of them off"
            )
        metrics = {
            **merge_run_metrics([r.metrics for r in rounds], side_by_side=False),
            **_staleness(trained, version),
        }
        sampling = round_metrics(scored, trained, first_flat, len(rounds), drawn_by, first.leftover)
        if self.spec_counts["spec_drafts"]:
            sampling |= spec_metrics(self.spec_counts, sampling["generated_tokens"], rounds_s, score_s)
        if source.needs_scores:
            sampling["source_score_s"] = score_s
        return Collected(trained, first.leftover, metrics, recorded, sampling=sampling)

    def collect(
        self,
        version: int,
        seed: int,
        plans: list[GroupPlan],
        target: int | None = None,
        grow: Callable[[GroupRecord, SampleRecord], GroupPlan | None] | None = None,
    ) -> Collected:
        """Run the plans' unfinished samples with the weights of policy `version` (each sample on its own
        stream; `seed` seeds stateful eviction, e.g. random, for the run); at most `target` complete groups
        are kept (by default every group, or rollout.prompts_per_step with partial rollouts, where decoding
        stops once that many are complete). `grow(group, sample)` (`GroupSource.grow`), asked as each sample
        finishes, plans samples that join the run (a backend that `grows_runs`)."""
        cfg = self.cfg
        self.backend.check_version(version)
        # two plans may extend one group
        groups = list({id(g): g for g in (self._group(p, version) for p in plans)}.values())
        if target is None:  # APRIL trains prompts_per_step of its over-provisioned groups; otherwise all
            target = cfg.prompts_per_step if cfg.partial.enable else len(groups)
        for g in groups:
            if g.finished and not g.complete:  # every sample a draft accepted whole: scored without decoding
                self._submit(g)
        pending = [(g, s) for g in groups for s in g.samples if not s.finished]
        requests = [self._request(s) for _, s in pending]
        finished_groups = sum(g.finished for g in groups)
        recorded: dict[int, Segment] = {}

        def on_segment(seg: Segment) -> list[Request] | None:
            nonlocal finished_groups
            g, s = pending[seg.index]
            if seg.tokens:
                s.extend(seg.tokens, seg.logps, seg.version)
            if self.backend.recording.any:
                recorded[id(s)] = seg
            if seg.finish is None:
                return None
            s.finish_reason = seg.finish
            joining = self._grown(g, s, grow, version)
            pending.extend((g, c) for c in joining)  # their indices continue the run's (grows_runs)
            if g.finished:
                finished_groups += 1
                self._submit(g)
            return [self._request(c) for c in joining]

        stop = (lambda: finished_groups >= target) if cfg.partial.enable else None
        sampling = Sampling(cfg.sampling_temperature, cfg.top_p, cfg.top_k, list(cfg.stop))
        run_metrics = {}
        if requests and not (stop is not None and stop()):  # leftovers may already complete the step
            run_metrics = self.backend.run(requests, sampling, version, seed, on_segment, stop)
        t0 = time.perf_counter()
        self._assign_rewards(groups)
        reward_wait = time.perf_counter() - t0
        complete = [g for g in groups if g.complete][:target]
        kept = {g.group_id for g in complete}
        leftover = [g for g in groups if g.group_id not in kept]
        if cfg.partial.mode == "mask_old":
            for g in complete:
                for s in g.samples:
                    s.mask_stale(version)
        metrics = {**run_metrics, **_staleness(complete, version)}
        metrics["reward_wait_s"] = reward_wait  # scoring left after decoding ended (the rest overlapped it)
        segments = (
            [recorded[id(s)] for g in complete for s in g.samples if id(s) in recorded] if recorded else []
        )
        return Collected(complete, leftover, metrics, segments, by_sample=recorded)

    def _grown(
        self,
        g: GroupRecord,
        s: SampleRecord,
        grow: Callable[[GroupRecord, SampleRecord], GroupPlan | None] | None,
        version: int,
    ) -> list[SampleRecord]:
        """The samples `grow` adds to group `g` now that its sample `s` finished, to decode in the same run
        (those whose drafts finished them excluded)."""
        plan = grow(g, s) if grow is not None else None
        if plan is None:
            return []
        self._group(plan, version)
        return [c for c in g.samples[-plan.n :] if not c.finished]

    def _score_samples(self, groups: list[GroupRecord], version: int) -> None:
        """Each sample's teacher-forced log-probs under the weights that drew it (for a source's cache): the
        samples drawn wholly by policy `version`, the weights held now. A sample an older policy drew in part
        or whole (APRIL's leftovers) stays unscored, so that no source caches it under the wrong weights."""
        samples = [s for g in groups for s in g.samples if s.tokens and set(s.versions) == {version}]
        prompts = [self.task.prompt_ids(s.prompt_id) for s in samples]
        logps = self.backend.score(prompts, [s.tokens for s in samples], self.cfg.temperature)
        for s, lp in zip(samples, logps, strict=True):
            s.scored_logps = lp

    def _submit(self, g: GroupRecord) -> None:
        """Score the group's samples not scored yet (all of them, but for a group a later round extended)."""
        todo = [s for s in g.samples if s.reward is None]
        texts = self.task.decode([s.tokens for s in todo])
        for s, text in zip(todo, texts, strict=True):
            s.text = text
        example = self.task.example(g.prompt_id)
        # a view that passes the tokens on to the reward functions says so (TaskView does)
        tokens = [list(s.tokens) for s in todo] if getattr(self.task, "takes_completion_ids", False) else None
        self.rewards.submit(g.group_id, self.task.scores, texts, [example] * len(todo), tokens)

    def _assign_rewards(self, groups: list[GroupRecord]) -> None:
        """Each scored sample's reward and the columns its reward functions logged (`log_extra`); the
        metrics they logged go to the task view (`log_metric`)."""
        rewards = self.rewards.wait()
        log = getattr(self.task, "log", None)
        for got in rewards.values():
            if log is not None:
                log(got.logs.metrics)
        for g in groups:
            if g.group_id in rewards:
                todo = [s for s in g.samples if s.reward is None]
                got = rewards[g.group_id]
                for i, (s, r) in enumerate(zip(todo, got, strict=True)):
                    s.reward = r
                    s.extras = {name: column[i] for name, column in got.logs.extras.items()} or None


def _staleness(groups: list[GroupRecord], version: int) -> dict[str, float]:
    """How off-policy the trained tokens are: recycled samples, token staleness, off-policy token fraction."""
    samples = [s for g in groups for s in g.samples]
    versions = torch.tensor([v for s in samples for v in s.versions], dtype=torch.float64)
    stale = version - versions
    some = stale.numel() > 0
    return {
        "recycled_frac": sum(s.start_version is not None and s.start_version < version for s in samples)
        / max(1, len(samples)),
        "staleness_mean": float(stale.mean()) if some else 0.0,
        "staleness_max": float(stale.max()) if some else 0.0,
        "off_policy_token_frac": float((stale > 0).double().mean()) if some else 0.0,
    }


def spec_metrics(c: dict[str, float], generated: float, rounds_s: float, score_s: float) -> dict[str, float]:
    """SPEC-RL's step (logged under sampling/): acceptance, reused tokens, verification seconds, and
    `spec_saved_s`, a rough estimate of the rollout seconds it saved: the reused tokens at this step's seconds
    per drawn token (the rounds' time but the verification's, prefill and planning included, over the tokens
    drawn), less the verification and the scoring for the cache; negative when they cost more than decoding
    the reused tokens would have, absent when nothing was drawn (no rate to price the reused tokens at)."""
    out = {
        "spec_accepted_frac": c["spec_accepted_tokens"] / max(1, c["spec_draft_tokens"]),
        "spec_whole_frac": c["spec_whole_drafts"] / max(1, c["spec_drafts"]),
        "spec_reused_tokens": float(c["spec_accepted_tokens"]),
        "spec_verify_s": c["spec_verify_s"],
        "spec_rollout_s": rounds_s
        + score_s,  # measured: the step's rounds, verification included, and scoring
    }
    if generated:
        per_token = (rounds_s - c["spec_verify_s"]) / generated
        out["spec_saved_s"] = c["spec_accepted_tokens"] * per_token - c["spec_verify_s"] - score_s
    return out


def round_metrics(
    scored: list[GroupRecord],
    trained: list[GroupRecord],
    first_flat: float,
    rounds: int,
    version: int,
    leftover: list[GroupRecord] = (),
) -> dict[str, float]:
    """What a step's rounds cost and gave, the same for every source (logged under sampling/): rounds run,
    tokens and samples drawn now (trained or not), the zero-variance fraction of the first round's groups
    and of the trained ones, the fraction of the step's prompts with a sample of reward > 0, reward per
    drawn token, and the groups scored but not trained."""
    drawn = [s for g in [*scored, *leftover] for s in g.samples]  # APRIL's leftovers drew tokens too
    tokens = sum(v == version for s in drawn for v in s.versions[s.reused_prefix :])
    solved = {g.prompt_id for g in scored if any(s.reward > 0 for s in g.samples)}
    return {
        "rounds": float(rounds),
        "generated_tokens": float(tokens),
        "generated_samples": float(
            sum(len(s.versions) > s.reused_prefix and s.versions[-1] == version for s in drawn)
        ),
        "zero_variance_frac_first_round": first_flat,
        "zero_variance_frac": _zero_variance_frac(trained),
        "solved_prompt_frac": len(solved) / max(1, len({g.prompt_id for g in scored})),
        "reward_per_token": sum(s.reward for g in scored for s in g.samples) / max(1, tokens),
        "dropped_groups": float(len(scored) - len(trained)),
        "trained_groups": float(len(trained)),
    }


def _zero_variance_frac(groups: list[GroupRecord]) -> float:
    """Fraction of groups whose rewards are all equal (zero GRPO advantage)."""
    flat = sum(len({s.reward for s in g.samples}) == 1 for g in groups)
    return flat / max(1, len(groups))
