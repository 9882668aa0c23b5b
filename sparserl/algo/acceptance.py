"""The acceptance rate between the sparse sampler and the dense policy, and its tail per length bin (Sparrow).

alpha_t = sum_v min(p_sparse(v), p_dense(v)) = 1 - TV(p_sparse, p_dense), for the next-token distributions of the
two actors on the same prefix (1: identical). Two estimates:

- `acceptance_topk`: the sum over the ids in both sides' top-k sets only, a lower bound (Sparrow measures this
  with k = 20). For identical distributions it is the top-k mass, not 1, unless the top-k holds all the mass.
- `acceptance_exact`: the sum over the whole vocabulary.

`acceptance_by_bin` pools alpha per bin of absolute position and reports its tail: P5, P1, the mean and the
fraction below tau (Sparrow's threshold, 0.86). The mean says little (most alpha_t are near 1); the tail
predicts collapse.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from sparserl.errors import UserError

MIN_BIN_TOKENS = 20  # fewer tokens than this in a bin: no tail statistics ("too few tokens")
TOO_FEW_TOKENS = "too few tokens"
MIN_BIN_SEQUENCES = 32  # fewer sequences than this in a bin: its P5 interval is wide (p5_stability), flagged
INTERVAL_LEVEL = 0.90  # the P5 interval's confidence level
BOOTSTRAP_RESAMPLES = 1000  # sequence-level bootstrap draws per interval


def _same_shape(a: Tensor, b: Tensor, names: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{names} differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")


def acceptance_topk(
    sparse_ids: Tensor, sparse_logprobs: Tensor, dense_ids: Tensor, dense_logprobs: Tensor
) -> Tensor:
    """Top-k lower bound of alpha [...]: sum of min(p_sparse, p_dense) over the ids in both top-k sets.

    Each side gives its top-k ids and log-probs [..., k] (ids distinct within a row; k may differ between the
    sides, the leading dims may not). A -inf log-prob (a token outside the sampler's top-k/top-p) adds nothing.
    """
    _same_shape(sparse_ids, sparse_logprobs, "acceptance_topk: sparse_ids and sparse_logprobs")
    _same_shape(dense_ids, dense_logprobs, "acceptance_topk: dense_ids and dense_logprobs")
    if sparse_ids.shape[:-1] != dense_ids.shape[:-1]:
        raise ValueError(
            f"acceptance_topk: the sparse side {tuple(sparse_ids.shape)} and the dense side "
            f"{tuple(dense_ids.shape)} cover different tokens (leading dims differ)"
        )
    both = sparse_ids[..., :, None] == dense_ids[..., None, :]  # [..., k_sparse, k_dense]
    low = torch.minimum(sparse_logprobs[..., :, None], dense_logprobs[..., None, :]).double().exp()
    return torch.where(both, low, 0.0).sum((-2, -1)).float()


def acceptance_exact(sparse_logprobs: Tensor, dense_logprobs: Tensor) -> Tensor:
    """Exact alpha [...] from the full log-probs [..., V] of both sides: sum_v min(p_sparse(v), p_dense(v))."""
    _same_shape(sparse_logprobs, dense_logprobs, "acceptance_exact: sparse_logprobs and dense_logprobs")
    return torch.minimum(sparse_logprobs, dense_logprobs).exp_().sum(-1, dtype=torch.float64).float()


@dataclass
class AcceptanceBin:
    """Alpha pooled over the tokens at absolute positions [start, end). With fewer than the minimum tokens the
    statistics are None and `note` says "too few tokens"."""

    index: int
    start: int
    end: int
    tokens: int
    p5: float | None = None
    p1: float | None = None
    mean: float | None = None
    frac_below_tau: float | None = None
    note: str = ""
    sequences: int | None = None  # distinct sequences with a token in the bin (None: not known)
    p5_low: float | None = None  # the P5's 90% interval, sequence-level bootstrap (None: not computed)
    p5_high: float | None = None

    def to_dict(self) -> dict[str, object]:
        """Plain dict for JSON reports."""
        return asdict(self)


def check_tau(tau: float, name: str = "tau") -> None:
    """Raise unless the acceptance threshold is a number in (0, 1]."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau <= 1.0:
        raise UserError(f"{name}={tau!r} must be in (0, 1] (the acceptance-rate threshold, e.g. 0.86)")


def bootstrap_quantile_draws(
    values: Tensor, sequences: Tensor, q: float, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> Tensor:
    """`resamples` bootstrap draws [resamples] of the q-quantile of `values` [N], resampling the sequences
    (`sequences` [N], one id per value) with replacement, since the tokens of one sequence are correlated and
    resampling tokens would understate the spread.

    A draw's quantile is the inverted-CDF one (the smallest value whose resampled weight reaches q), computed
    as a weighted quantile (a token's weight: how often its sequence was drawn) over values sorted once."""
    if values.numel() == 0 or values.shape != sequences.shape:
        raise ValueError(f"bootstrap_quantile_draws: need matching non-empty values and sequences, got "
                         f"{tuple(values.shape)} and {tuple(sequences.shape)}")  # fmt: skip
    order = values.argsort()
    sorted_values = values[order].double()
    _, seq_of_token = torch.unique(sequences[order], return_inverse=True)
    count = int(seq_of_token.max()) + 1
    g = torch.Generator().manual_seed(seed)
    draws = []
    for start in range(0, resamples, 100):  # 100 draws at a time: [100, N] weights, not [resamples, N]
        r = min(100, resamples - start)
        picks = torch.randint(count, (r, count), generator=g)
        weight = torch.zeros(r, count).scatter_add_(1, picks, torch.ones(r, count))[:, seq_of_token]
        cumulative = weight.cumsum(1)
        at = torch.searchsorted(cumulative, q * cumulative[:, -1:]).clamp(max=len(order) - 1)
        draws.append(sorted_values[at.squeeze(1)])
    return torch.cat(draws)


def percentile_interval(draws: Tensor, level: float = INTERVAL_LEVEL) -> tuple[float, float]:
    """The central `level` interval of bootstrap draws (their (1 - level) / 2 and (1 + level) / 2 quantiles)."""
    low, high = torch.quantile(draws.double(), torch.tensor([(1 - level) / 2, (1 + level) / 2]).double())
    return low.item(), high.item()


def bootstrap_quantile_interval(
    values: Tensor,
    sequences: Tensor,
    q: float,
    level: float = INTERVAL_LEVEL,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """The `level` interval of the q-quantile of `values` by a sequence-level bootstrap
    (`bootstrap_quantile_draws`)."""
    return percentile_interval(bootstrap_quantile_draws(values, sequences, q, resamples, seed), level)


def acceptance_by_bin(
    alpha: Tensor,
    positions: Tensor,
    bin_width: int,
    tau: float,
    min_tokens: int = MIN_BIN_TOKENS,
    sequences: Tensor | None = None,
    resamples: int = 0,
) -> list[AcceptanceBin]:
    """Per bin of absolute position (bin i holds positions [i * bin_width, (i + 1) * bin_width)), from bin 0 to
    the last holding a token: its token count and, with at least `min_tokens` tokens, the P5 and P1 of alpha
    (linear interpolation between order statistics, as numpy's default), its mean and the fraction below tau.

    With `sequences` (the sequence id of each token), also each bin's number of sequences and, with `resamples`
    > 0 and at least 2 sequences, the P5's 90% interval (`bootstrap_quantile_interval`, seeded by the bin)."""
    _same_shape(alpha, positions, "acceptance_by_bin: alpha and positions")
    if sequences is not None:
        _same_shape(alpha, sequences, "acceptance_by_bin: alpha and sequences")
    check_tau(tau)
    if isinstance(bin_width, bool) or not isinstance(bin_width, int) or bin_width < 1:
        raise UserError(
            f"bin_width={bin_width!r} must be an integer >= 1 (tokens of absolute position per bin)"
        )
    if min_tokens < 1:
        raise UserError(f"min_tokens={min_tokens!r} must be >= 1")
    alpha, positions = alpha.reshape(-1).double(), positions.reshape(-1)
    if alpha.numel() == 0:
        return []
    if int(positions.min()) < 0:
        raise ValueError(f"acceptance_by_bin: positions must be >= 0, got {int(positions.min())}")
    which = torch.div(positions, bin_width, rounding_mode="floor").long()
    bins = []
    for i in range(int(which.max()) + 1):
        values = alpha[which == i]
        out = AcceptanceBin(i, i * bin_width, (i + 1) * bin_width, values.numel())
        seqs = sequences.reshape(-1)[which == i] if sequences is not None else None
        out.sequences = None if seqs is None else int(torch.unique(seqs).numel())
        if out.tokens < min_tokens:
            out.note = TOO_FEW_TOKENS
        else:
            p5, p1 = torch.quantile(
                values, torch.tensor([0.05, 0.01], dtype=values.dtype, device=values.device)
            ).tolist()
            out.p5, out.p1, out.mean = p5, p1, values.mean().item()
            out.frac_below_tau = (values < tau).double().mean().item()
            if seqs is not None and resamples > 0 and out.sequences >= 2:
                out.p5_low, out.p5_high = bootstrap_quantile_interval(
                    values, seqs, 0.05, resamples=resamples, seed=i
                )
        bins.append(out)
    return bins


def acceptance_metrics(bins_by_estimate: dict[str, list[AcceptanceBin]]) -> dict[str, float]:
    """Scalar metrics of binned alpha: `alpha/<estimate>/{p5,p1,mean,frac_below_tau}/bin<i>` for the bins with
    enough tokens, and `alpha/tokens/bin<i>` for every bin (the same count for every estimate)."""
    out: dict[str, float] = {}
    for estimate, bins in bins_by_estimate.items():
        for b in bins:
            out[f"alpha/tokens/bin{b.index}"] = float(b.tokens)
            for stat in ("p5", "p1", "mean", "frac_below_tau"):
                value = getattr(b, stat)
                if value is not None and math.isfinite(value):
                    out[f"alpha/{estimate}/{stat}/bin{b.index}"] = value
    return out
