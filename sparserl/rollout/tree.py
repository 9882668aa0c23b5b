"""Tree rollouts (`rollout.tree`, TreeRL's EPTree; BranchGRPO's language-model analogue): a group's first-round
samples are the roots; every path, once finished and while fewer than `rounds` forks deep, forks at its `forks`
most uncertain tokens (the highest -log p of the sampled token, as TreeRL's code measures it), into `children`
children. A child keeps the path's tokens before the fork point with the parent's sampler log-probs (the
distribution that drew them) and draws from the fork point on, on its own stream (`child_key`: its parent's
key, fork point and number, so it draws the same tokens wherever and whenever it runs), so its first token is
drawn afresh. Children join the parent's group (one group id per tree: every path is a leaf) and, on a backend
that `grows_runs`, the run that drew their parent as it finishes (`grow`); elsewhere the step's next round
(`refill`). Shared prefixes are not generated again (`reused_prefix`), nor prefilled: every path that forks
later keeps its states at its `forks` least likely tokens (`GroupPlan.snapshots`, engine/forks.py) and a child
starts from its parent's state there (`Draft.fork_of`), where the backend that runs it holds it (for the
weights that made it; a Ray worker keeps its own); else the child prefills its prompt and prefix.
"""

from __future__ import annotations

from typing import Any

from sparserl.rollout.records import GroupRecord, SampleRecord
from sparserl.rollout.sources import (
    Draft,
    GroupPlan,
    GroupSource,
    WrappedSource,
    register_wrapper,
)
from sparserl.seeds import derive_key


def fork_points(s: SampleRecord, forks: int) -> list[int]:
    """The `forks` positions of the path's own tokens (after its inherited prefix) with the lowest sampler
    log-prob, earliest first among equals, in increasing order."""
    own = range(s.reused_prefix, len(s.tokens))
    return sorted(sorted(own, key=lambda t: (s.sampler_logps[t], t))[:forks])


def child_key(parent_key: int, position: int, child: int) -> int:
    """The stream key of child number `child` forked at completion `position` of the path drawn on
    `parent_key`: a 62-bit hash of the three (keys of first-round samples stay below 2^56), independent of when
    the child is planned or where in its group it lands."""
    return derive_key(parent_key, position, child)


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
        self.step = {"tree_leaves": 0.0, "tree_forks": 0.0}
        self.reset_step()

    def plan(self, k: int, version: int) -> list[GroupPlan]:
        plans = super().plan(k, version)
        for p in plans:  # the roots keep their fork states
            p.snapshots = self.cfg.forks
        return plans

    def reset_step(self) -> None:
        self.depth: dict[tuple[int, int], int] = {}  # (group id, sample index) -> forks above the path
        self.forked: set[tuple[int, int]] = set()  # the paths whose children were planned
        self.step = dict.fromkeys(self.step, 0.0)

    def grow(self, group: GroupRecord, sample: SampleRecord) -> GroupPlan | None:
        """In the run that drew it (a backend that `grows_runs`): the children of `sample` as it finishes."""
        return self.inner.grow(group, sample) or self._fork(group, [sample])

    def refill(self, scored: list[GroupRecord], k: int, version: int) -> list[GroupPlan]:
        """After a round: the children of every path not forked yet (none left when they grew in flight)."""
        more = self.inner.refill(scored, k, version)
        if more:
            return more
        plans = [p for g in scored if (p := self._fork(g, g.samples)) is not None]
        added = {id(p.extends): p.n for p in plans}
        self.step["tree_leaves"] = sum(len(g.samples) + added.get(id(g), 0) for g in scored) / max(
            1, len(scored)
        )
        return plans

    def _fork(self, g: GroupRecord, paths: list[SampleRecord]) -> GroupPlan | None:
        """One plan adding the children of those `paths` of `g` not forked yet and fewer than `rounds` forks
        deep (each path forks once, finished); they keep their fork states if they fork later."""
        todo = [
            s for s in paths
            if (g.group_id, s.sample_index) not in self.forked and self._depth(g, s) < self.cfg.rounds
        ]  # fmt: skip
        drafts, depths = [], []
        for s in todo:
            self.forked.add((g.group_id, s.sample_index))
            for t in fork_points(s, self.cfg.forks):
                parent = Draft(s.tokens[:t], s.sampler_logps[:t], verify=False, origin="forked",
                               fork_of=(s.seed, s.key, t))  # fmt: skip
                drafts += [parent] * self.cfg.children
                depths += [self._depth(g, s) + 1] * self.cfg.children
        if not drafts:
            return None
        start, first = len(g.samples), g.samples[0]
        self.depth |= {(g.group_id, start + j): d for j, d in enumerate(depths)}
        self.step["tree_forks"] += len(drafts) / self.cfg.children
        keys = [child_key(d.fork_of[1], d.fork_of[2], j % self.cfg.children) for j, d in enumerate(drafts)]
        more = min(depths) < self.cfg.rounds  # some of these children fork later
        return GroupPlan(g.prompt_id, first.seed, keys, extends=g, drafts=drafts,
                         snapshots=self.cfg.forks if more else 0)  # fmt: skip

    def _depth(self, g: GroupRecord, s: SampleRecord) -> int:
        return self.depth.get((g.group_id, s.sample_index), 0)  # a root: 0

    def metrics(self) -> dict[str, float]:
        return {**{f"sampling/{k}": v for k, v in self.step.items()}, **self.inner.metrics()}
