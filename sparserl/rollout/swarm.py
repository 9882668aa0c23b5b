"""SAPO (Swarm sAmpling Policy Optimization): independent trainers (nodes), each with its own policy, share their
finished rollouts through a pool, a named Ray actor, and never their weights. Each step a node trains on its
`rollout.prompts_per_step` local groups plus `distributed.swarm.shared_groups` groups drawn from the other nodes'
latest ones; their rewards are recomputed here, their tokens are taken as they are (same tokenizer) or
re-tokenised from their text, and kept whole (sources.Draft) with this node's current log-probs as their
sampler's (ratio 1, as SAPO) or the sender's. With shared_groups 0 a node only publishes, and trains exactly as
a single node (tested).
"""

from __future__ import annotations

import random
from typing import Any

from sparserl.config.checks import sampler_records
from sparserl.config.errors import ConfigError
from sparserl.rollout.records import GroupRecord
from sparserl.rollout.sources import Draft, GroupPlan, GroupSource, WrappedSource, register_wrapper, step_seed


class SwarmPool:
    """The shared pool (a Ray actor): groups published by each node, newest last, the oldest forgotten past
    `capacity`."""

    def __init__(self, capacity: int = 4096) -> None:
        self.groups: list[tuple[int, dict[str, Any]]] = []
        self.capacity = capacity

    def publish(self, node: int, groups: list[dict[str, Any]]) -> int:
        self.groups = (self.groups + [(node, g) for g in groups])[-self.capacity :]
        return len(self.groups)

    def draw(self, node: int, count: int, window: int, seed: int) -> list[dict[str, Any]]:
        """Up to `count` groups, uniformly among the other nodes' latest `window`, by a seeded draw."""
        theirs = [g for n, g in self.groups if n != node][-window:]
        return random.Random(seed).sample(theirs, min(count, len(theirs)))


def tokenizer_id(tokenizer: Any) -> str:
    return f"{getattr(tokenizer, 'name_or_path', '')}:{len(tokenizer)}"


@register_wrapper("swarm")
class SwarmSharing(WrappedSource):
    """Around any source: its plans plus the drawn groups (as plans of kept-whole drafts), and its trained
    local groups published after each step. The pool is external: a resume draws afresh from it."""

    order, key = 40, "distributed.swarm.enable=true"

    @classmethod
    def around(cls, inner: GroupSource) -> WrappedSource:
        return cls(inner, inner.ctx.cfg, inner.ctx.tokenizer)

    @classmethod
    def check(cls, cfg: Any) -> None:
        """Drawn groups are trained at the step that draws them, as drafts kept whole (not recorded)."""
        shared = cfg.distributed.swarm.shared_groups
        if shared and cfg.rollout.partial.enable:
            raise ConfigError(
                "distributed.swarm.shared_groups > 0 with rollout.partial.enable=true: APRIL's stop counts "
                "rollout.prompts_per_step groups and would leave the drawn ones for later; turn one of them off"
            )
        recording = sampler_records(cfg)
        if shared and recording:
            raise ConfigError(
                "distributed.swarm.shared_groups starts samples from others, whose distributions and held "
                f"positions are not recorded: it cannot run with {' or '.join(recording)}"
            )

    def __init__(self, inner: GroupSource, cfg: Any, tokenizer: Any) -> None:
        import ray

        from sparserl.distributed.cluster import init_ray

        super().__init__(inner)
        self.cfg, self.tokenizer = cfg.distributed.swarm, tokenizer
        if not ray.is_initialized():
            init_ray(ray, cfg.distributed)
        actor = ray.remote(SwarmPool).options(name=self.cfg.pool, get_if_exists=True, lifetime="detached")
        self.pool, self.ray = actor.remote(), ray
        self.rows, self.me, self.drawn = set(inner.ctx.rows), tokenizer_id(tokenizer), 0
        self.step = {
            "swarm_external_groups": 0.0,
            "swarm_retokenised_groups": 0.0,
            "swarm_published_groups": 0.0,
        }

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        plans = self.inner.plan(k, version)
        self.step["swarm_external_groups"] = self.step["swarm_retokenised_groups"] = 0.0
        self.drawn = 0
        if self.cfg.shared_groups:
            seed = step_seed(self.ctx.seed, version) + self.cfg.node
            drawn = self.ray.get(
                self.pool.draw.remote(self.cfg.node, self.cfg.shared_groups, self.cfg.window, seed)
            )
            plans += [self._external(g, version) for g in drawn if g["row"] in self.rows]
            self.drawn = int(self.step["swarm_external_groups"])
        return plans

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        return self.inner.refill(scored, k + self.drawn, version)  # the drawn groups count on top of k

    def select(self, scored: list[GroupRecord], k: int) -> list[GroupRecord]:
        return self.inner.select(scored, k + self.drawn)

    def _external(self, g: dict[str, Any], version: int) -> GroupPlan:
        """A drawn group as a plan of kept-whole drafts on fresh streams of its row."""
        plan = self.new_group(g["row"], version)
        same = g["tokenizer"] == self.me
        self.step["swarm_external_groups"] += 1
        self.step["swarm_retokenised_groups"] += not same
        drafts = []
        for s in g["samples"][: plan.n]:
            tokens = s["tokens"] if same else self.tokenizer.encode(s["text"], add_special_tokens=False)
            sender = same and self.cfg.correction == "sender_logp"
            drafts.append(
                Draft(tokens, s["logps"] if sender else None, s["finish"], verify=False, origin="external")
            )
        plan.keys = plan.keys[: len(drafts)]
        plan.drafts = drafts
        return plan

    def observe(self, groups: list[GroupRecord], leftover: list[GroupRecord]) -> None:
        local = [g for g in groups if all(s.prefix_origin != "external" for s in g.samples)]
        shared = [
            {"row": g.prompt_id, "tokenizer": self.me,
             "samples": [{"tokens": s.tokens, "text": s.text, "logps": s.sampler_logps, "finish": s.finish_reason}
                         for s in g.samples]}
            for g in local
        ]  # fmt: skip
        if shared:
            self.ray.get(self.pool.publish.remote(self.cfg.node, shared))
        self.step["swarm_published_groups"] += len(shared)
        self.inner.observe(groups, leftover)

    def metrics(self) -> dict[str, float]:
        return {**{f"sampling/{k}": v for k, v in self.step.items()}, **self.inner.metrics()}
