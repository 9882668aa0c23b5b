"""What a rollout hands the trainer: one record per sample, with per-token provenance, grouped by prompt; and
what the backend's segments are asked to record besides tokens (`Recording`).

A token carries the policy version that sampled it, so that a token drawn in an earlier step (APRIL's resumed
samples) can be told from one drawn now, and a loss mask can leave stale tokens out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Recording:
    """What the samples' segments carry besides tokens: the sampler's top-k / full log-probs per token (alpha),
    its kept sets (the keep-sampling mask) and the positions an evicting cache held (a teacher-forced replay)."""

    top_logprobs: int = 0
    full_logprobs: bool = False
    held: bool = False
    kept_sets: bool = False

    @property
    def any(self) -> bool:
        return bool(self.top_logprobs or self.full_logprobs or self.held or self.kept_sets)


@dataclass
class SampleRecord:
    """One completion of a prompt, built up over one or more rollout segments.

    Per token: `tokens`, `sampler_logps` (log p of the distribution it was drawn from, sparse KV included),
    `versions` (the policy version that drew it) and `loss_mask` (1 = trained). Per sample: its prompt
    (`prompt_id`, the task row), `group_id`, `sample_index` within the group, the (`seed`, `key`) of its random
    stream, `finish_reason` (None while unfinished), and once scored its decoded `text` and `reward`; the
    number of leading tokens reused from a verified draft (SPEC-RL's `reused_prefix`); `extras`, the values the
    reward functions logged for it with `log_extra` (the completions table's columns).
    """

    prompt_id: int
    group_id: int
    sample_index: int
    seed: int
    key: int
    tokens: list[int] = field(default_factory=list)
    sampler_logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    max_new_tokens: int | None = None  # this sample's cap when its plan gave one, else rollout.max_new_tokens
    reused_prefix: int = (
        0  # leading tokens taken from a draft (SPEC-RL, a given prefix, SAPO), not drawn here
    )
    prefix_origin: str | None = None  # where they came from: 'reused' (SPEC-RL), 'given', 'external' (SAPO)
    scored_logps: list[float] | None = None  # the backend's teacher-forced log-probs, when a source asks
    snapshots: int = 0  # states to keep for forks (GroupPlan.snapshots)
    fork_of: tuple[int, int, int] | None = None  # the (seed, key, position) of the state it starts from
    text: str | None = None
    reward: float | None = None
    extras: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.fork_of is not None:  # a key of the backend's states, a list when read back from JSON
            self.fork_of = tuple(self.fork_of)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def start_version(self) -> int | None:
        return self.versions[0] if self.versions else None

    def extend(self, tokens: list[int], logps: list[float], version: int) -> None:
        """Append a segment drawn by policy `version`."""
        if len(tokens) != len(logps):
            raise ValueError(f"sample {self.key}: {len(tokens)} tokens but {len(logps)} log-probs")
        if self.versions and version < self.versions[-1]:
            raise ValueError(f"sample {self.key}: version {version} after {self.versions[-1]}")
        self.tokens += tokens
        self.sampler_logps += [float(x) for x in logps]
        self.versions += [version] * len(tokens)
        self.loss_mask += [1] * len(tokens)

    def mask_stale(self, version: int) -> None:
        """Leave out of the loss every token drawn by a policy older than `version`."""
        self.loss_mask = [int(m and v >= version) for m, v in zip(self.loss_mask, self.versions, strict=True)]

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
        known = {f.name for f in fields(SampleRecord)}  # older checkpoints also stored per-token origins
        samples = [SampleRecord(**{k: v for k, v in s.items() if k in known}) for s in d["samples"]]
        return cls(d["group_id"], d["prompt_id"], samples)
