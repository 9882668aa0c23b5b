"""Tree advantages (TreeRL's process reward, paper form): the leaves of a group share token prefixes (a tree of
rollouts, `rollout.tree`); every token's advantage is its node's value against the root's (global) plus against
its parent segment's (local), V(node) being the mean reward of the leaves below it.

Nodes are the group's token prefixes, so the tree is read off the leaves' tokens (a prefix trie) and needs no
parent pointers: token t of leaf i sits at node prefix[:t+1]; its segment starts where the set of leaves sharing
the prefix last shrank, and its parent segment's value is the node just before that. INFERENCE (the paper form,
Eq. 2 + Eq. 3 as quoted in THUDM/TreeRL#2): TreeRL's code also uses leave-one-out leaf values, a token-mean
subtraction and a sqrt(leaves) division, which are not done here; each leaf trains its whole path, so a shared
prefix counts once per leaf below it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sparserl.algo.advantages import AdvantageTransform, register_adv_transform


def tree_advantages(rewards: Tensor, group_index: Tensor, tokens: Sequence[Sequence[int]]) -> Tensor:
    """Token-level advantages [B, T] (T the longest completion; 0 past a completion's end)."""
    width = max((len(t) for t in tokens), default=0)
    out = torch.zeros(len(tokens), width, dtype=torch.float64)
    r = rewards.double()
    for gid in torch.unique(group_index).tolist():
        rows = torch.nonzero(group_index == gid).flatten().tolist()
        values = _node_values([tokens[i] for i in rows], [float(r[i]) for i in rows])
        root = float(r[rows].mean())
        for k, i in enumerate(rows):
            parent, size = root, len(rows)
            for t, (value, count) in enumerate(values[k]):
                if (
                    count < size
                ):  # the leaves sharing the prefix shrank: a new segment, its parent the node before
                    parent, size = (values[k][t - 1][0] if t else root), count
                out[i, t] = (value - root) + (value - parent)
    return out.to(torch.promote_types(rewards.dtype, torch.float32))


def _node_values(paths: list[Sequence[int]], rewards: list[float]) -> dict[int, list[tuple[float, int]]]:
    """Per leaf (its index in the group's rows as given by position), per token: (V, leaves) of its node."""
    node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    leaves: dict[int, list[int]] = {}
    walk = []
    for j, path in enumerate(paths):
        node, nodes = -1, []
        for token in path:
            node = node_of.setdefault((node, token), len(node_of))
            leaves.setdefault(node, []).append(j)
            nodes.append(node)
        walk.append(nodes)
    stats = {n: (sum(rewards[j] for j in js) / len(js), len(js)) for n, js in leaves.items()}
    return {k: [stats[n] for n in nodes] for k, nodes in enumerate(walk)}


@register_adv_transform("tree")
class TreeAdvantages(AdvantageTransform):
    """`algo.adv_transforms=[tree]`: replaces the advantages by `tree_advantages` over the completions' tokens
    (with `rollout.tree`; in a group of independent samples, no two starting with the same token, every token
    gets 2 x (R_i - mean R))."""

    needs_tokens = True

    def __call__(self, adv, rewards, group_index, texts, tokens=None):
        if tokens is None:
            raise ValueError("the 'tree' advantage transform needs the completions' tokens")
        return tree_advantages(rewards, group_index, tokens)
