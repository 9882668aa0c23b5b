"""R-KV: importance (SnapKV's pooled window attention) minus redundancy among near-duplicate keys.

score = lambda * I - (1 - lambda) * R. Redundancy R_j is a softmax over slots of the mean cosine similarity
that key j has with the others; for each key, its most recent near-duplicate (similarity above the threshold)
is exempted, so the newest copy of a repeated phrase survives and older copies go first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparserl.engine.compression.base import EvictionMethod, SlotView, max_pool, window_attention


def redundancy(keys: Tensor, candidates: Tensor, threshold: float) -> Tensor:
    """R [r, H, S]: softmax over candidate slots of their mean similarity to the other candidates."""
    k = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = torch.matmul(k, k.transpose(-1, -2))  # [r, H, S, S]
    s = sim.shape[-1]
    pair = candidates[:, None, :, None] & candidates[:, None, None, :]
    pair = pair & ~torch.eye(s, dtype=torch.bool, device=sim.device)
    sim = sim * pair
    near = sim > threshold
    newest = (near * torch.arange(1, s + 1, device=sim.device)).argmax(dim=-1, keepdim=True)  # 0 if none
    sim = sim.scatter(-1, newest, torch.where(near.any(-1, keepdim=True), 0.0, sim.gather(-1, newest)))
    count = candidates.sum(-1).clamp(min=1)[:, None, None].float()
    mean = sim.sum(dim=-2) / count  # column mean over the rows i
    return mean.masked_fill(~candidates[:, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)


class RKV(EvictionMethod):
    def score(self, view: SlotView) -> Tensor:
        importance = max_pool(window_attention(view), self.cfg.pool_kernel)
        lam = self.cfg.rkv_lambda
        return lam * importance - (1 - lam) * redundancy(
            view.keys, view.candidates, self.cfg.rkv_similarity_threshold
        )
