"""Tree rollouts (`rollout.tree`, TreeRL's EPTree; BranchGRPO's language-model analogue): a group's first-round
samples are the roots; at each forking round, every path drawn in the last round forks at its `forks` most
uncertain tokens (the highest -log p of the sampled token, as TreeRL's code measures it), into `children`
children. A child keeps the path's tokens before the fork point with the parent's sampler log-probs (the
distribution that drew them) and draws from the fork point on, on its own stream, so its first token is drawn
afresh. Children join the parent's group (one group id per tree: every path is a leaf). Shared prefixes are not
generated again (`reused_prefix`), nor prefilled: every path that forks later keeps its states at its `forks`
least likely tokens (`GroupPlan.snapshots`, engine/forks.py) and a child starts from its parent's state there
(`Draft.fork_of`), where the backend that runs it holds it (for the weights that made it; a Ray worker keeps
its own); else the child prefills its prompt and prefix.
"""

from __future__ import annotations

from typing import Any

from sparserl.rollout.records import GroupRecord, SampleRecord
from sparserl.rollout.sources import (
    EXTENSION_SHIFT,
    Draft,
    GroupPlan,
    GroupSource,
    WrappedSource,
    register_wrapper,
)


def fork_points(s: SampleRecord, forks: int) -> list[int]:
    """The `forks` positions of the path's own tokens (after its inherited prefix) with the lowest sampler
    log-prob, earliest first among equals, in increasing order."""
    own = range(s.reused_prefix, len(s.tokens))
    return sorted(sorted(own, key=lambda t: (s.sampler_logps[t], t))[:forks])


@register_wrapper("tree")
class TreeRollouts(WrappedSource):
    """Around any source: its groups grown as trees (see the module docstring)."""

    refills = True
    recordable = False
    grows_groups = True  # a tree's group is its leaves
    needs_its_rounds = True  # the forking rounds asked for
    order, key = 10, "rollout.tree.enable=true"

    @classmethod
    def around(cls, inner: GroupSource) -> WrappedSource:
        return cls(inner, inner.ctx.cfg.rollout.tree)

    @classmethod
    def rounds(cls, cfg: Any) -> int:
        return cfg.rollout.tree.rounds  # one per forking round

    def __init__(self, inner: GroupSource, cfg: Any) -> None:
        super().__init__(inner)
        self.cfg = cfg
        self.forked: dict[int, int] = {}
        self.frontier: dict[int, range] = {}
        self.step = {"tree_leaves": 0.0, "tree_forks": 0.0}

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        plans = super().plan(k, version)
        for p in plans:  # the roots fork in the first forking round
            p.snapshots = self.cfg.forks if self.cfg.rounds else 0
        return plans

    def reset_step(self) -> None:
        self.forked, self.frontier = {}, {}  # group id -> forking rounds done, sample indices drawn last
        self.step = dict.fromkeys(self.step, 0.0)

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        more = self.inner.refill(scored, k, version)
        if more:
            return more
        growing = [g for g in scored if self.forked.get(g.group_id, 0) < self.cfg.rounds]
        for g in growing:
            self.forked[g.group_id] = self.forked.get(g.group_id, 0) + 1
        plans = [p for g in growing if (p := self._fork(g)) is not None]
        added = {id(p.extends): p.n for p in plans}
        self.step["tree_leaves"] = sum(len(g.samples) + added.get(id(g), 0) for g in scored) / max(
            1, len(scored)
        )
        return plans

    def _fork(self, g: GroupRecord) -> GroupPlan | None:
        """One plan adding the children of every path the last round drew in `g`."""
        last = self.frontier.get(g.group_id, range(len(g.samples)))
        drafts = []
        for s in (g.samples[i] for i in last):
            for t in fork_points(s, self.cfg.forks):
                parent = Draft(s.tokens[:t], s.sampler_logps[:t], verify=False, origin="forked",
                               fork_of=(s.seed, s.key, t))  # fmt: skip
                drafts += [parent] * self.cfg.children
        if not drafts:
            return None
        start, first = len(g.samples), g.samples[0]
        self.frontier[g.group_id] = range(start, start + len(drafts))
        self.step["tree_forks"] += len(drafts) / self.cfg.children
        keys = [first.key + (j << EXTENSION_SHIFT) for j in range(start, start + len(drafts))]
        more = self.forked[g.group_id] < self.cfg.rounds  # these children fork in a later round
        return GroupPlan(g.prompt_id, first.seed, keys, extends=g, drafts=drafts,
                         snapshots=self.cfg.forks if more else 0)  # fmt: skip

    def metrics(self) -> dict[str, float]:
        return {**{f"sampling/{k}": v for k, v in self.step.items()}, **self.inner.metrics()}
