"""mean@k and the unbiased pass@k estimator over n sampled completions per prompt."""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k draws is correct) from n samples with c correct:
    1 - C(n - c, k) / C(n, k) (Chen et al. 2021), computed as a stable product."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, then n itself (1, 2, 4, ..., n)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def summarize_rewards(rewards: Sequence[Sequence[float]], pass_threshold: float = 1.0) -> dict[str, float]:
    """`mean@n` (mean reward over prompts and samples) and `pass@k` for each k of `pass_ks(n)`, from
    `rewards[prompt][sample]`; a sample counts as correct when its reward >= `pass_threshold`."""
    if not rewards:
        raise ValueError("summarize_rewards: no prompts")
    n = len(rewards[0])
    if n < 1 or any(len(r) != n for r in rewards):
        raise ValueError("summarize_rewards: every prompt needs the same number (>= 1) of samples")
    out = {f"mean@{n}": sum(sum(r) / n for r in rewards) / len(rewards)}
    correct = [sum(1 for x in r if x >= pass_threshold - 1e-9) for r in rewards]
    for k in pass_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(rewards)
    return out
