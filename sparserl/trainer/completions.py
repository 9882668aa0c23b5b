"""The completions table: one row per sample of a step, for reading what the policy wrote and how it was scored.

A row holds the step, the group, the prompt as the model saw it, the completion, its reward and advantage, the
mean log-prob gap of the sampler to the log-probs the corrections compare it with (pi_old, or the learner's own
pass), whether the corrections rejected it whole, and the columns users' reward functions logged for it
(`log_extra`; verl's extra dict keys). `logging.completions` caps the rows per step (0: no table);
`MetricSinks.log_completions` writes them to RUN_DIR/completions.jsonl and to the trackers' table types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

COMPLETIONS_FILE = "completions.jsonl"
COLUMNS = ("step", "group", "prompt", "completion", "reward", "advantage", "logp_gap", "rejected")


@dataclass
class SampleStats:
    """Per sample of an update's batch: `logp_gap`, the mean over its response tokens of log p_sampler - log
    p_reference (None for a sample without usable tokens), and `rejected`, True when the corrections dropped
    every one of its tokens (a rejected sequence)."""

    logp_gap: list[float | None]
    rejected: list[bool]


def sample_stats(reference: Tensor, sampler: Tensor, mask: Tensor, keep: Tensor) -> SampleStats:
    """`SampleStats` from [B, T] log-probs, the usable response `mask` and the corrections' `keep` mask."""
    counts = mask.sum(dim=1)
    gaps = ((sampler - reference) * mask).nan_to_num(0.0).sum(dim=1) / counts.clamp(min=1)
    has = (counts > 0).tolist()
    rejected = (counts > 0) & ~(keep & mask).any(dim=1)
    return SampleStats(
        [float(g) if h else None for g, h in zip(gaps.tolist(), has, strict=True)], rejected.tolist()
    )


def _advantage(advantages: Tensor, row: int, length: int) -> float:
    """A sample's advantage: its own, or the mean over its tokens of per-token advantages."""
    adv = advantages[row]
    if adv.dim() == 0:
        return float(adv)
    return float(adv[:length].mean()) if length else 0.0


def completion_rows(
    step: int, samples: Sequence[Any], advantages: Tensor, view: Any, cap: int
) -> list[dict[str, Any]]:
    """The first `cap` samples' rows (rollout.records.SampleRecord, in batch order: whole groups first);
    `logp_gap` and `rejected` stay None until `with_stats`. The prompt is the task view's prompt tokens
    decoded: the chat-templated text the model saw."""
    rows = []
    for i, s in enumerate(samples[: max(0, cap)]):
        fixed = {
            "step": step,
            "group": s.group_id,
            "prompt": view.tokenizer.decode(view.prompt_ids(s.prompt_id)),
            "completion": s.text or "",
            "reward": s.reward,
            "advantage": _advantage(advantages, i, len(s.tokens)),
            "logp_gap": None,
            "rejected": None,
        }
        rows.append({**(s.extras or {}), **fixed})
    return rows


def with_stats(rows: list[dict[str, Any]] | None, learner: Any) -> list[dict[str, Any]]:
    """`rows` (None: no table) with each sample's log-prob gap and rejection from the `learner`'s last update
    (trainer/update.py `sample_stats`; a learner group's come from its rank 0)."""
    rows = rows or []
    stats: SampleStats | None = getattr(learner, "sample_stats", None)
    if stats is not None:
        for i, row in enumerate(rows):
            row["logp_gap"], row["rejected"] = stats.logp_gap[i], stats.rejected[i]
    return rows


def columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The table's columns: the fixed ones, then the logged ones in the order they first appear."""
    extra = dict.fromkeys(k for row in rows for k in row if k not in COLUMNS)
    return [*COLUMNS, *extra]


def markdown(rows: Sequence[dict[str, Any]], width: int = 300) -> str:
    """`rows` as a Markdown table (TensorBoard's text plugin renders it), each cell cut to `width` characters."""

    def cell(value: Any) -> str:
        text = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        text = text if len(text) <= width else text[: width - 3] + "..."
        return text.replace("|", "\\|").replace("\n", "<br>")

    names = columns(rows)
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(cell(row.get(n)) for n in names) + " |" for row in rows]
    return "\n".join(lines)
