"""Per-sample positions held and read over the decode steps of one `generate` call: the memory a sequence
occupies (held) and the attention work of a step (read), which differ under block-sparse attention only."""

from __future__ import annotations

import torch
from torch import Tensor


class PositionStats:
    """Accumulates, per sample, the positions held and read at every decode step (after its token is written).

    `held` counts the positions a sequence holds in a layer; `read` those one sparse layer's KV head attends to
    (every held position, except under block-sparse attention, whose dense layers still read all of them).
    A sample that gets no decode step (one token) reports what its prompt left after prefill.
    """

    def __init__(self, held_after_prefill: Tensor):
        zeros = torch.zeros(
            held_after_prefill.shape[0], dtype=torch.float64, device=held_after_prefill.device
        )
        self.initial = held_after_prefill.double()
        self.held_peak = held_after_prefill.clone()
        self.held_sum, self.read_sum, self.read_peak, self.retained_sum = (zeros.clone() for _ in range(4))
        self.steps = torch.zeros_like(held_after_prefill)

    def extend(self, samples: int) -> None:
        """Room for `samples` more samples (a run's requests added while it runs), nothing held yet."""
        for name in ("initial", "held_peak", "steps", "held_sum", "read_sum", "read_peak", "retained_sum"):
            setattr(self, name, torch.nn.functional.pad(getattr(self, name), (0, samples)))

    def start(self, samples: Tensor, held: Tensor) -> None:
        """The given samples were (re-)admitted and hold `held` positions after their prefill."""
        self.initial[samples] = held.double()
        self.held_peak[samples] = torch.maximum(self.held_peak[samples], held)

    def add(self, samples: Tensor, held: Tensor, read: Tensor, total: Tensor) -> None:
        """One decode step of the given samples: positions held, read, and in the whole sequence (total)."""
        self.held_peak[samples] = torch.maximum(self.held_peak[samples], held)
        self.held_sum[samples] += held
        self.read_sum[samples] += read
        self.read_peak[samples] = torch.maximum(self.read_peak[samples], read.double())
        self.retained_sum[samples] += held / total
        self.steps[samples] += 1

    def _per_sample(self) -> dict[str, Tensor]:
        stepped = self.steps > 0
        steps = self.steps.clamp(min=1)
        return {
            "kv_peak_positions": self.held_peak,
            "held_positions_mean": torch.where(stepped, self.held_sum / steps, self.initial),
            "read_positions_mean": torch.where(stepped, self.read_sum / steps, self.initial),
            "read_positions_peak": torch.where(stepped, self.read_peak, self.initial),
            "retained_fraction": torch.where(stepped, self.retained_sum / steps, 1.0),
        }

    def sample_stats(self) -> list[dict[str, float]]:
        """One stats dict per sample (Sample.stats' position entries)."""
        columns = {name: values.tolist() for name, values in self._per_sample().items()}
        return [
            {name: (int(v[i]) if name == "kv_peak_positions" else float(v[i])) for name, v in columns.items()}
            for i in range(self.steps.shape[0])
        ]

    def summary(self) -> dict[str, float]:
        """Call-level entries: peaks over samples, means over all decode steps of all samples, the mean over
        samples of the retained fraction."""
        per = self._per_sample()
        steps = int(self.steps.sum())

        def step_mean(total: Tensor) -> float:
            return float(total.sum() / steps) if steps else float(self.initial.mean())

        return {
            "peak_kv_positions": float(self.held_peak.max()),
            "held_positions_mean": step_mean(self.held_sum),
            "read_positions_mean": step_mean(self.read_sum),
            "read_positions_peak": float(per["read_positions_peak"].max()),
            "retained_fraction": float(per["retained_fraction"].mean()),
        }
