"""SPEC-RL: a returning prompt's previous responses are drafts. Each is verified teacher-forced under the current
policy; its prefix up to the first rejected token is kept and the sample goes on from there (a draft accepted
whole, its end included, is delivered without decoding).

Two acceptance rules (rollout.spec.acceptance). 'coupled' (default): a draft was drawn by inverting the sampler's
CDF at its stream's uniform numbers, so the current policy redraws each position at the same number, teacher-
forced; the draft is kept up to the first position where the two differ, and the sample continues on the
draft's stream: it is exactly the sample the current policy draws on that stream. 'ratio': SPEC-RL's test, with
fresh uniforms every step (SPEC-RL's code draws the same ones every call) and no residual resampling at the cut
(the rejected token is drawn afresh from the current policy, as in SPEC-RL): a token survives with probability
min(p_then, p_now) and the cut mixes in p_now, so delivered samples lean toward the policy that drew the
drafts (tests/test_reuse.py measures it); residual resampling would need p_then's whole distribution.

`SpecReuse` wraps any group source: it attaches the cached drafts to the plans of prompts it has seen, and
after each step caches the trained samples with the verifier's log-probs under the weights that drew them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sparserl.config.rollout import SpecConfig
from sparserl.engine.sampling import sample_uniforms
from sparserl.rollout.records import GroupRecord, SampleRecord
from sparserl.rollout.sources import Draft, GroupPlan, GroupSource, WrappedSource, register_wrapper
from sparserl.seeds import derive_seed

SPEC_STREAM = 7  # derive_seed purpose: the verification's uniforms, apart from the sampling streams


def accepted_length(
    logp_now: Sequence[float], logp_then: Sequence[float], uniforms: Sequence[float], lenience: float = 0.0
) -> int:
    """SPEC-RL's cut: token t is accepted iff u_t <= min(1, e^lenience p_now(y_t) / p_then(y_t)); the prefix
    before the first rejection is kept. delta >= 0 accepts without looking at u, so unchanged weights and
    lenience 0 accept every token exactly."""
    for t, (now, then, u) in enumerate(zip(logp_now, logp_then, uniforms, strict=True)):
        delta = now - then + lenience
        if delta < 0 and not (u > 0 and math.log(u) <= delta):
            return t
    return len(logp_now)


def verification_uniforms(step_seed: int, key: int, length: int) -> list[float]:
    """The uniforms sample `key` verifies its draft with at the step of `step_seed`: fresh each step."""
    return sample_uniforms(derive_seed(step_seed, SPEC_STREAM), [key], length)[0].tolist()


@register_wrapper("spec")
class SpecReuse(WrappedSource):
    """SPEC-RL around any source: plans of prompts seen before carry their last responses as drafts (one per
    sample, as many as were cached); the trained groups' samples are cached with their verified log-probs,
    the prompts cached longest ago leaving first past `max_cached_tokens`."""

    recordable = False  # drafts: a sample starts from an earlier one
    order, key = 30, "rollout.spec.enable=true"

    @classmethod
    def around(cls, inner: GroupSource) -> WrappedSource:
        return cls(inner, inner.ctx.cfg.rollout.spec)

    def __init__(self, inner: GroupSource, cfg: SpecConfig) -> None:
        super().__init__(inner)
        self.cfg = cfg
        self.cache: dict[int, list[dict[str, Any]]] = {}  # row -> [{tokens, logps, finish}], oldest row first

    @property
    def coupled(self) -> bool:
        return self.cfg.acceptance == "coupled"

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        plans, drafted = self.inner.plan(k, version), set()
        for p in plans:
            cached = self.cache.get(p.row, [])
            # a prompt planned twice drafts once: two samples on one stream would be one sample twice (coupled)
            if p.resume is None and p.extends is None and cached and p.row not in drafted:
                drafted.add(p.row)
                drafts = [self._draft(d) for d in cached[: p.n]]
                p.drafts = drafts + [None] * (p.n - len(drafts))
        return plans

    def _draft(self, d: dict[str, Any]) -> Draft:
        if self.coupled:
            return Draft(d["tokens"], finish=d["finish"], stream=tuple(d["stream"]))
        return Draft(d["tokens"], d["logps"], d["finish"])

    @property
    def needs_scores(self) -> bool:
        return not self.coupled  # coupled drafts carry their stream, not log-probs

    def _entry(self, s: SampleRecord) -> dict[str, Any] | None:
        """A trained sample as a draft: its tokens, end, and its stream (coupled) or its scored log-probs (ratio:
        none when it was not scored under the weights that drew it)."""
        if not s.tokens:
            return None
        if self.coupled:
            return {"tokens": list(s.tokens), "finish": s.finish_reason, "stream": [s.seed, s.key]}
        if s.scored_logps is None:
            return None
        return {"tokens": list(s.tokens), "logps": list(s.scored_logps), "finish": s.finish_reason}

    def observe(self, groups: list[GroupRecord], leftover: list[GroupRecord]) -> None:
        for g in groups:
            self.cache.pop(g.prompt_id, None)  # re-inserted last: the newest
            self.cache[g.prompt_id] = [e for s in g.samples if (e := self._entry(s)) is not None]
        total = sum(len(d["tokens"]) for ds in self.cache.values() for d in ds)
        while self.cache and total > self.cfg.max_cached_tokens:
            oldest = next(iter(self.cache))
            total -= sum(len(d["tokens"]) for d in self.cache.pop(oldest))
        self.inner.observe(groups, leftover)

    def metrics(self) -> dict[str, float]:
        tokens = sum(len(d["tokens"]) for ds in self.cache.values() for d in ds)
        return {"sampling/spec_cached_prompts": float(len(self.cache)), "sampling/spec_cached_tokens": float(tokens),
                **self.inner.metrics()}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"cache": [[row, ds] for row, ds in self.cache.items()], "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cache = {int(row): ds for row, ds in state["cache"]}
        self.inner.load_state_dict(state["inner"])
