"""R-KV: importance (SnapKV's pooled window attention) minus redundancy among near-duplicate keys.

score = lambda * I - (1 - lambda) * R. Redundancy R_j is a softmax over all held slots (window included) of the
mean cosine similarity that key j has with the others; for each key, its most recent near-duplicate
(similarity above the threshold) is exempted, so the newest copy of a repeated phrase survives and older copies
go first. Only the candidates' entries of R compete.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparserl.engine.compression.base import (
    EVICTION_METHODS,
    EvictionMethod,
    SlotView,
    max_pool,
    window_attention,
)


def newest_near_duplicate(k: Tensor, threshold: float, block: int) -> Tensor:
    """For normalised keys k [B, S, D], the index of the most recent other key j with k_i . k_j > threshold, or -1.

    Searched newest first: every key against the last `block` keys, then only the keys still without a match
    against the older ones. Real keys have near-duplicates almost everywhere (measured on SmolLM2: 99% of keys
    find one among the last 128), so this costs ~block/S of the full S x S similarity; without any, it costs
    about the full one.
    """
    b, s, _ = k.shape
    start = max(s - block, 0)
    rank = torch.arange(1, s + 1, dtype=torch.int16 if s < 2**15 else torch.int32, device=k.device)
    sim = torch.matmul(k, k[:, start:].transpose(1, 2))  # [B, S, S - start]
    sim[:, start:].diagonal(dim1=1, dim2=2).zero_()
    # (near * 1-based slot).amax is the last near-duplicate, 0 if none (cheaper than an argmax)
    newest = ((sim > threshold) * rank[start:]).amax(dim=-1).long() - 1
    if start == 0:
        return newest
    for row in (newest < 0).any(dim=-1).nonzero().squeeze(-1).tolist():
        todo = (newest[row] < 0).nonzero().squeeze(-1)
        sim = torch.matmul(k[row, todo], k[row, :start].T)  # [u, start]
        own = todo < start
        sim[own.nonzero().squeeze(-1), todo[own]] = 0.0
        newest[row, todo] = ((sim > threshold) * rank[:start]).amax(dim=-1).long() - 1
    return newest


def redundancy(keys: Tensor, held: Tensor, threshold: float, block: int = 128) -> Tensor:
    """R [r, H, S]: softmax over the L held slots of each key's mean cosine similarity to the held keys, as the
    reference code computes it: S = K^ K^T with a zero diagonal; in each row i the entry of i's most recent
    near-duplicate j* (S_ij > threshold) is zeroed, or the entry of slot 0 when i has none; R = softmax_j of
    the column means over all L rows. The caller uses the candidates' entries.

    The column sums come from the sum of the normalised keys (O(S D)); the S x S similarity is only searched
    for each key's most recent near-duplicate (`newest_near_duplicate`).
    """
    r, h, s, d = keys.shape
    k = torch.nn.functional.normalize(keys.float(), dim=-1) * held[:, None, :, None]  # others are 0
    newest = newest_near_duplicate(k.view(r * h, s, d), threshold, block).view(r, h, s).clamp(min=0)
    dropped = (k * k.gather(2, newest[..., None].expand_as(k))).sum(-1)  # S[i, j*_i]
    dropped = dropped * (newest != torch.arange(s, device=k.device))  # key 0 without a duplicate: S_00 is 0
    col = (k.sum(dim=-2, keepdim=True) * k).sum(-1) - (k * k).sum(-1)  # sum over i != j of S_ij
    col = col.scatter_add(-1, newest, -dropped)
    mean = col / held.sum(-1).clamp(min=1)[:, None, None].float()
    return mean.masked_fill(~held[:, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)


@EVICTION_METHODS.register("rkv")
class RKV(EvictionMethod):
    def score(self, view: SlotView) -> Tensor:
        importance = max_pool(window_attention(view), self.cfg.pool_kernel)
        lam = self.cfg.rkv_lambda
        return lam * importance - (1 - lam) * redundancy(
            view.keys, view.held, self.cfg.rkv_similarity_threshold
        )
