"""What a rollout hands the trainer: one record per sample, with per-token provenance, grouped by prompt.

A token carries the policy version that sampled it and its origin, so that corrections can tell a stale token
(resumed from an earlier step, APRIL) from a sparse one, and a loss mask can leave stale tokens out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SAMPLED = "sampled"  # drawn in the step that trains on it
RESUMED = "resumed"  # drawn in an earlier step, kept while the sample was unfinished and continued now


@dataclass
class SampleRecord:
    """One completion of a prompt, built up over one or more rollout segments.

    Per token: `tokens`, `sampler_logps` (log p of the distribution it was drawn from, sparse KV included),
    `versions` (the policy version that drew it), `origins` and `loss_mask` (1 = trained). Per sample: its
    prompt (`prompt_id`, the task row), `group_id`, `sample_index` within the group, the (`seed`, `key`) of its
    random stream, `reward` and `finish_reason` (None while unfinished).
    """

    prompt_id: int
    group_id: int
    sample_index: int
    seed: int
    key: int
    tokens: list[int] = field(default_factory=list)
    sampler_logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    reward: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def start_version(self) -> int | None:
        return self.versions[0] if self.versions else None

    @property
    def end_version(self) -> int | None:
        return self.versions[-1] if self.versions else None

    def extend(self, tokens: list[int], logps: list[float], version: int) -> None:
        """Append a segment drawn by policy `version`; tokens from earlier segments become `resumed`."""
        if len(tokens) != len(logps):
            raise ValueError(f"sample {self.key}: {len(tokens)} tokens but {len(logps)} log-probs")
        if self.versions and version < self.versions[-1]:
            raise ValueError(f"sample {self.key}: version {version} after {self.versions[-1]}")
        self.origins = [RESUMED] * len(self.tokens)
        self.tokens += tokens
        self.sampler_logps += [float(x) for x in logps]
        self.versions += [version] * len(tokens)
        self.origins += [SAMPLED] * len(tokens)
        self.loss_mask += [1] * len(tokens)

    def mask_stale(self, version: int) -> None:
        """Leave out of the loss every token drawn by a policy older than `version`."""
        self.loss_mask = [int(m and v >= version) for m, v in zip(self.loss_mask, self.versions, strict=True)]

    def check(self) -> None:
        """The record's invariants: one entry per token in every per-token list, versions never decrease."""
        n = len(self.tokens)
        lengths = [len(x) for x in (self.sampler_logps, self.versions, self.origins, self.loss_mask)]
        if any(m != n for m in lengths):
            raise AssertionError(f"sample {self.key}: per-token lists of lengths {[n, *lengths]}")
        if any(b < a for a, b in zip(self.versions, self.versions[1:], strict=False)):
            raise AssertionError(f"sample {self.key}: versions decrease {self.versions}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GroupRecord:
    """The n samples of one prompt (a GRPO group). Complete when every sample is finished and scored."""

    group_id: int
    prompt_id: int
    samples: list[SampleRecord]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def complete(self) -> bool:
        return all(s.finished and s.reward is not None for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "samples": [s.to_dict() for s in self.samples],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupRecord:
        return cls(d["group_id"], d["prompt_id"], [SampleRecord(**s) for s in d["samples"]])
