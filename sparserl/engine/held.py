"""What an evicting sampler held, per sample: the positions each layer and KV head kept after every cut. A
teacher-forced forward replays eviction from it as an attention mask (`sparse_scoring`, DistillSparse for
eviction methods).

Between two cuts a row only appends the token it feeds, so a sample's record is its cuts alone: at the decode
step of each cut (and at its first step, which holds the prompt, cut or whole), the held positions per layer and
head, the fed token's included. A query at position i then reads the last cut's set at or before i, plus every
position after that cut up to i.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from sparserl.engine.cache import KVCache


@dataclass
class HeldRecord:
    """One sample's cuts: `fed[e]` is the position fed at cut e's decode step, `held[e]` the positions
    [layers, kv_heads, n_e] each layer and head held at that step (`fed[e]` included)."""

    fed: list[int] = field(default_factory=list)
    held: list[Tensor] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready (a checkpoint's probe batch)."""
        return {"fed": list(self.fed), "held": [h.tolist() for h in self.held]}

    @classmethod
    def from_dict(cls, d: dict) -> HeldRecord:
        return cls(list(d["fed"]), [torch.tensor(h, dtype=torch.int32) for h in d["held"]])


class HeldRecorder:
    """A `RolloutEngine` step hook recording `HeldRecord`s by sample index: a snapshot of the held positions
    whenever a row's length did not grow by exactly the fed token since its last step."""

    def __init__(self) -> None:
        self.records: dict[int, HeldRecord] = {}
        self._length: dict[int, int] = {}

    def __call__(self, step: int, cache: KVCache, samples: Tensor) -> None:
        lengths = cache.held().tolist()  # a prompt held once counts the slots a row still holds in it
        slots: list[Tensor] = []
        for row, sample in enumerate(samples.tolist()):
            if sample < 0:
                continue
            n = lengths[row]
            if self._length.get(sample, -1) + 1 != n:  # a sample's first step, or a cut
                slots = slots or [
                    cache.eviction_slots(layer, slice(None))[1] for layer in range(cache.num_layers)
                ]
                pos = torch.stack([slots[layer][row, :, :n] for layer in range(cache.num_layers)])
                record = self.records.setdefault(sample, HeldRecord())
                record.fed.append(int(pos.max()))
                record.held.append(pos.cpu())
            self._length[sample] = n


def held_mask(record: HeldRecord, layer: int, first: int, end: int, width: int) -> Tensor:
    """Keys [kv_heads, end - first, width] that the queries at positions first..end-1 read in `layer`."""
    keys = torch.arange(width)
    queries = torch.arange(first, end)
    out = torch.zeros(record.held[0].shape[1], end - first, width, dtype=torch.bool)
    for e, fed in enumerate(record.fed):
        upto = record.fed[e + 1] if e + 1 < len(record.fed) else end
        rows = (queries >= fed) & (queries < upto)
        if not bool(rows.any()):
            continue
        held = torch.zeros(out.shape[0], width, dtype=torch.bool)
        held.scatter_(1, record.held[e][layer].long(), True)
        later = (keys[None] > fed) & (keys[None] <= queries[rows][:, None])  # appended since the cut
        out[:, rows] = held[:, None, :] | later[None]
    return out
