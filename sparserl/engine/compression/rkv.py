"""R-KV: importance (SnapKV's pooled window attention) minus redundancy among near-duplicate keys.

score = lambda * I - (1 - lambda) * R. Redundancy R_j is a softmax over slots of the mean cosine similarity
that key j has with the others; for each key, its most recent near-duplicate (similarity above the threshold)
is exempted, so the newest copy of a repeated phrase survives and older copies go first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparserl.engine.compression.base import EvictionMethod, SlotView, max_pool, window_attention


def redundancy(keys: Tensor, candidates: Tensor, threshold: float, chunk: int = 128) -> Tensor:
    """R [r, H, S]: softmax over candidate slots of their mean cosine similarity to the other candidates, where
    each key's similarity to its most recent near-duplicate (> threshold) does not count.

    The S x S similarity is only needed to find those near-duplicates, so it is built `chunk` rows at a time
    (cache-sized blocks); the column sums come from the sum of the normalised keys (O(S D)).
    """
    k = torch.nn.functional.normalize(keys.float(), dim=-1) * candidates[:, None, :, None]
    s = k.shape[-2]
    k_t = k.transpose(-1, -2)
    # 1-based slot numbers; (near * rank).amax is the last near-duplicate, 0 if none (cheaper than argmax)
    rank = torch.arange(1, s + 1, dtype=torch.int16 if s < 2**15 else torch.int32, device=k.device)
    newest = torch.empty(k.shape[:-1], dtype=torch.long, device=k.device)  # last near-duplicate j of key i
    dropped = torch.empty(k.shape[:-1], device=k.device)  # S[i, newest_i], or 0 where key i has none
    for a in range(0, s, chunk):
        sim = torch.matmul(k[:, :, a : a + chunk], k_t)  # [r, H, c, S]
        sim.diagonal(offset=a, dim1=-2, dim2=-1).zero_()
        last = ((sim > threshold) * rank).amax(dim=-1).long()  # [r, H, c], 1-based
        idx = (last - 1).clamp(min=0)
        newest[:, :, a : a + chunk] = idx
        dropped[:, :, a : a + chunk] = sim.gather(-1, idx[..., None]).squeeze(-1) * (last > 0)
    # column sums over i != j of S_ij (non-candidates are zero vectors), minus the exempted entries
    col = (k.sum(dim=-2, keepdim=True) * k).sum(-1) - (k * k).sum(-1)
    col = col.scatter_add(-1, newest, -dropped)
    mean = col / candidates.sum(-1).clamp(min=1)[:, None, None].float()
    return mean.masked_fill(~candidates[:, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)


class RKV(EvictionMethod):
    def score(self, view: SlotView) -> Tensor:
        importance = max_pool(window_attention(view), self.cfg.pool_kernel)
        lam = self.cfg.rkv_lambda
        return lam * importance - (1 - lam) * redundancy(
            view.keys, view.candidates, self.cfg.rkv_similarity_threshold
        )
