"""Next-token sampling that reports the log-probability under the distribution actually sampled from, and, on
request, that distribution itself (its top-k, or all of it) for the acceptance rate (sparserl.algo.acceptance).

Randomness is per sample: each draw inverts the sampled distribution's CDF at one uniform number that is a pure
function of (seed, the sample's key, the step), so a sample's tokens do not depend on which other samples share
its batch, and no [N, V] random tensor is drawn per step (torch.multinomial draws one exponential per
vocabulary entry: 17% of a batch-16 SmolLM2 decode step on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sparserl.algo.keep_sampling import pack_kept

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment and mixing constants
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 (numpy's unsigned arithmetic wraps modulo 2**64 as the algorithm
    needs; torch has no unsigned 64-bit multiply on the CPU, and no counter-based generator we could key)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN_GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def sample_uniforms(seed: int, keys: Sequence[int], steps: int, device=None) -> Tensor:
    """Uniform numbers in [0, 1), float64 [len(keys), steps]: entry (i, t) depends only on (seed, keys[i], t).
    Keys and seed are hashed in turn, then each step's counter, so nearby seeds or keys give unrelated streams."""
    keys = np.asarray(list(keys), dtype=np.uint64)
    stream = _splitmix64(_splitmix64(np.uint64(seed % 2**64) + np.zeros_like(keys)) ^ keys)
    bits = _splitmix64(stream[:, None] + np.arange(steps, dtype=np.uint64)[None, :])
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53).to(device)


def draw(weights: Tensor, uniforms: Tensor, block: int = 256) -> Tensor:
    """One token per row of `weights` [N, V] (probabilities up to a factor per row; 0 for removed tokens) by
    inverting its CDF at `uniforms` [N]: the first id whose cumulative weight exceeds u x total, so each id is
    drawn with its probability (up to rounding of the sums) and a zero-probability id never is. Two levels, so
    that only V / `block` block sums and one block are accumulated, not all V entries: a block is chosen by its
    mass, then an id within it. Block sums are float32 (a float64 pass over [N, V] cost 2.3 ms of a 9 ms
    batch-16 draw; 256 terms lose ~1e-7 relative), their running sum and the block's float64."""
    n, vocab = weights.shape
    probs = weights
    if vocab % block:
        probs = torch.nn.functional.pad(probs, (0, block - vocab % block))
    blocks = probs.view(n, -1, block)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    target = uniforms.to(block_cdf)[:, None] * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[-1] - 1)
    before = block_cdf.gather(-1, (chosen - 1).clamp(min=0)) * (chosen > 0)
    inner_cdf = blocks[torch.arange(n, device=weights.device), chosen[:, 0]].double().cumsum(dim=-1)
    # the block's own running sum may end a rounding error away from its total: keep the target inside it
    inner = (target - before).clamp(min=0).minimum(inner_cdf[:, -1:].nextafter(inner_cdf.new_zeros(())))
    within = torch.searchsorted(inner_cdf, inner, right=True)
    return (chosen * block + within).squeeze(-1)


def processed_logprobs(
    logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
) -> Tensor:
    """Log-probs [N, V] after temperature, top-k and top-p (removed tokens get -inf); temperature 0 is greedy,
    a point mass on the argmax (log-prob 0 there, -inf elsewhere)."""
    if temperature <= 0:
        return point_mass(logits.argmax(dim=-1), logits.shape[-1])
    return processed_logits(logits, temperature, top_p, top_k).log_softmax(dim=-1)


def processed_logits(logits: Tensor, temperature: float, top_p: float, top_k: int) -> Tensor:
    """Float32 logits [N, V] / temperature (> 0), with the tokens top-k and top-p remove set to -inf."""
    logits = logits.float()
    if temperature != 1.0:  # at T = 1 the division would be a pass over [N, V] for nothing
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass of the tokens ranked above it already reaches top_p
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def point_mass(tokens: Tensor, vocab: int) -> Tensor:
    """Log-probs [N, V] of the distributions that put all their mass on `tokens` [N] (greedy decoding)."""
    out = torch.full((tokens.shape[0], vocab), float("-inf"), device=tokens.device)
    return out.scatter_(-1, tokens[:, None], 0.0)


def sample_next(
    logits: Tensor,
    uniforms: Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    with_distribution: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Sampled tokens [N] (one per row, drawn at that row's uniform number, `uniforms` [N]), their log-probs [N]
    and, with `with_distribution`, the processed log-probs [N, V] they were drawn from (else None).
    Temperature 0 is greedy (log-prob 0: a point mass)."""
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
        dist = point_mass(tokens, logits.shape[-1]) if with_distribution else None
        return tokens, torch.zeros(logits.shape[0], device=logits.device), dist
    # one max and one exp pass serve both the draw and the log-probs (log_softmax + exp took three more)
    logits = processed_logits(logits, temperature, top_p, top_k)
    top = logits.max(dim=-1, keepdim=True).values
    weights = (logits - top).exp_()
    tokens = draw(weights, uniforms)
    log_total = top + weights.sum(dim=-1, keepdim=True).log()
    logp = logits.gather(-1, tokens[:, None]).squeeze(-1) - log_total.squeeze(-1)
    return tokens, logp, (logits - log_total) if with_distribution else None


@dataclass
class TokenDistributions:
    """The next-token distribution at each position of one completion: the `k` most likely ids and their
    log-probs [T, k] (most likely first), all log-probs [T, V] and the kept sets as bits when asked (else None).
    Float32 (bits: uint8), CPU."""

    top_ids: Tensor
    top_logprobs: Tensor
    full_logprobs: Tensor | None = None
    kept: Tensor | None = None  # [T, ceil(V / 8)] uint8: the ids top-k / top-p kept (algo/keep_sampling.py)


def check_distribution_request(top_logprobs: int, vocab: int, caller: str) -> None:
    """Refuse a top-k size outside [0, vocab] before any work is done."""
    if isinstance(top_logprobs, bool) or not 0 <= top_logprobs <= vocab:
        raise ValueError(
            f"{caller}: top_logprobs={top_logprobs!r} must be an integer in [0, {vocab}] (0 = off)"
        )


def distributions_of(logp: Tensor, top_logprobs: int, full_logprobs: bool) -> TokenDistributions:
    """Top-k (and optionally all) of the log-probs [..., V] as a TokenDistributions on the CPU."""
    values, ids = logp.topk(top_logprobs, dim=-1)
    return TokenDistributions(ids.cpu(), values.float().cpu(), logp.float().cpu() if full_logprobs else None)


class DistributionRecorder:
    """Keeps, decode step by decode step, the top-k (and optionally full) log-probs of the distribution each
    row sampled from, and on request its kept set as bits (the keep-sampling mask). Memory: 12 bytes x k per
    token; the full distributions go to one CPU buffer per row of `steps` x V floats, allocated when first
    written (the OS commits only the pages a row's tokens fill), and are handed to the samples without a copy
    unless the row finished early; the kept sets, V / 8 bytes per row and step, to one CPU buffer."""

    def __init__(
        self,
        rows: int,
        steps: int,
        top_logprobs: int,
        full_logprobs: bool,
        device: torch.device,
        kept_sets: bool = False,
    ):
        self.k, self.steps, self.full_logprobs, self.kept_sets = top_logprobs, steps, full_logprobs, kept_sets
        self.top_ids = torch.zeros(rows, steps, top_logprobs, dtype=torch.long, device=device)
        self.top_logprobs = torch.zeros(rows, steps, top_logprobs, device=device)
        self.full: list[Tensor | None] = []  # per row [steps, V], from the first step on
        self.kept: Tensor | None = None  # [rows, steps, ceil(V / 8)] uint8, from the first step on

    @classmethod
    def maybe(cls, *args: Any, **kwargs: Any) -> DistributionRecorder | None:
        """A recorder (the constructor's arguments) when anything is asked for, else None (nothing is computed
        or kept: the empty top-k buffers it made are dropped)."""
        recorder = cls(*args, **kwargs)
        return recorder if recorder.k or recorder.full_logprobs or recorder.kept_sets else None

    def record(self, steps: Tensor, rows: Tensor, logp: Tensor) -> None:
        """Keep the distributions `logp` [len(rows), V] of the sample rows `rows` at their tokens `steps`."""
        values, ids = logp.topk(self.k, dim=-1)
        self.top_ids[rows, steps], self.top_logprobs[rows, steps] = ids, values
        if self.kept_sets:
            bits = pack_kept(logp).cpu()
            if self.kept is None:
                self.kept = torch.zeros(len(self.top_ids), self.steps, bits.shape[-1], dtype=torch.uint8)
            self.kept[rows.cpu(), steps.cpu()] = bits
        if self.full_logprobs:
            if not self.full:
                self.full = [torch.empty(self.steps, logp.shape[-1]) for _ in range(len(self.top_ids))]
            for row, step, row_logp in zip(rows.tolist(), steps.tolist(), logp.float().cpu(), strict=True):
                self.full[row][step] = row_logp

    def take(self, i: int, length: int) -> TokenDistributions:
        """Row i's distributions for its first `length` tokens; its full buffer is released as it is handed
        over (without a copy when the row ran to the last step)."""
        full = None
        if self.full_logprobs:
            full = self.full[i] if length == self.steps else self.full[i][:length].clone()
            self.full[i] = None
        kept = self.kept[i, :length].clone() if self.kept is not None else None
        return TokenDistributions(
            self.top_ids[i, :length].cpu(), self.top_logprobs[i, :length].float().cpu(), full, kept
        )

    def attach(self, samples: Sequence) -> None:
        """Set `distributions` on each sample (row i of the recorder is `samples[i]`), trimmed to its length."""
        for i, s in enumerate(samples):
            s.distributions = self.take(i, len(s.completion_ids))
