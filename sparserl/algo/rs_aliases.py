"""verl's rollout-correction rejection names (`rollout_rs`) as aliases of this library's rules.

verl (rollout_corr_helper.py) writes log r_t = log pi_old - log pi_rollout (log xi here, clamped to +-20 as
here), k1_t = -log r_t, k2_t = (log r_t)^2 / 2, k3_t = r_t - 1 - log r_t, and keeps a token or sequence whose
statistic is <= an upper bound (k2, k3) or inside [log lo, log hi] ('lo_hi'; one number u means lo = 1/u)
for k1. Where one of our rules decides exactly the same, the name maps to its config fields; where none
does, the name is refused with the reason, never approximated.

Equivalent (same kept set, up to rounding at the bound itself):
- token_k1 lo_hi -> token rejection, xi in [1/hi, 1/lo]   (verl bounds -log r, so the bounds flip)
- token_k2 t     -> token rejection, |log xi| <= sqrt(2 t): xi in [exp(-sqrt(2 t)), exp(sqrt(2 t))]
- token_k3 t     -> token rejection, xi in [a, b], the two roots of x - 1 - log x = t (k3 is monotone on
                    each side of 1)
- seq_mean_k1 lo_hi -> Geo-RS, geometric-mean xi in [1/hi, 1/lo]
- seq_mean_k3 t  -> K3-RS with threshold t
- seq_max_k2 t   -> the two-sided outlier veto, every token's xi in [exp(-sqrt(2 t)), exp(sqrt(2 t))]
- seq_max_k3 t   -> the two-sided outlier veto, every token's xi in token_k3's [a, b]
"""

from __future__ import annotations

import math
from collections.abc import Callable

# Options with no rule of ours that decides the same; the reason is part of the error.
NO_EQUIVALENT: dict[str, str] = {
    "seq_sum_k1": "Seq-MIS rejects on the same statistic (prod_t xi_t) but also weights each sequence by it; "
    "there is no rejection-only sequence-product rule",
    "seq_sum_k2": "no rule bounds the sum over a sequence of (log xi)^2 / 2",
    "seq_sum_k3": "no rule bounds the sum over a sequence of k3 (K3-RS bounds its mean: seq_mean_k3)",
    "seq_mean_k2": "no rule bounds the mean of (log xi)^2 / 2 (Geo-RS bounds the mean of log xi: seq_mean_k1)",
}


def _k1_bounds(spec: str) -> tuple[float, float]:
    """verl's k1 threshold 'lo_hi' (or 'u', lo = 1/u) as ratio bounds."""
    lo_s, hi_s = spec.split("_", 1) if "_" in spec else (str(1.0 / float(spec)), spec)
    lo, hi = float(lo_s), float(hi_s)
    if not 0 < lo <= hi:
        raise ValueError(f"k1 bounds {spec!r} must satisfy 0 < lower <= upper")
    return lo, hi


def _upper(spec: str) -> float:
    t = float(spec)
    if not t > 0:
        raise ValueError(f"threshold {spec!r} must be > 0")
    return t


def k3_ratio_bounds(t: float) -> tuple[float, float]:
    """The ratios a < 1 < b with a - 1 - log a = b - 1 - log b = t (bisection in log space)."""

    def excess(x: float) -> float:  # k3 at log-ratio x, minus t
        return math.expm1(x) - x - t

    def root(lo: float, hi: float) -> float:  # excess changes sign once on [lo, hi]
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if (excess(mid) > 0) == (excess(lo) > 0) else (lo, mid)
        return 0.5 * (lo + hi)

    # k3 = 0 at log-ratio 0, > t at -(t + 1) and at t + 1 (e^y > 2y for y > 0)
    return math.exp(root(-(t + 1.0), 0.0)), math.exp(root(0.0, min(t + 1.0, 700.0)))


def _token_k1(spec: str) -> dict[str, float]:
    lo, hi = _k1_bounds(spec)
    return {"token_rs_low": 1.0 / hi, "token_rs_high": 1.0 / lo}


def _token_k2(spec: str) -> dict[str, float]:
    half_width = math.sqrt(2.0 * _upper(spec))
    return {"token_rs_low": math.exp(-half_width), "token_rs_high": math.exp(half_width)}


def _token_k3(spec: str) -> dict[str, float]:
    lo, hi = k3_ratio_bounds(_upper(spec))
    return {"token_rs_low": lo, "token_rs_high": hi}


def _seq_max(token_bounds: dict[str, float]) -> dict[str, float]:
    """A token rule's xi bounds as the outlier veto's: one token outside them rejects its sequence."""
    return {
        "outlier_token_is_threshold_low": token_bounds["token_rs_low"],
        "outlier_token_is_threshold_high": token_bounds["token_rs_high"],
    }


def _seq_mean_k1(spec: str) -> dict[str, float]:
    lo, hi = _k1_bounds(spec)
    return {"geo_rs_low": 1.0 / hi, "geo_rs_high": 1.0 / lo}


def _seq_mean_k3(spec: str) -> dict[str, float]:
    return {"k3_rs_threshold": _upper(spec)}


# name -> (threshold spec -> {config field: bound}); each bound is ANDed with what the config already sets
ALIASES: dict[str, Callable[[str], dict[str, float]]] = {
    "token_k1": _token_k1,
    "token_k2": _token_k2,
    "token_k3": _token_k3,
    "seq_mean_k1": _seq_mean_k1,
    "seq_mean_k3": _seq_mean_k3,
    "seq_max_k2": lambda spec: _seq_max(_token_k2(spec)),
    "seq_max_k3": lambda spec: _seq_max(_token_k3(spec)),
}


def rollout_rs_overrides(entries: list[str]) -> dict[str, float]:
    """Config fields for `algo.rollout_rs` entries 'name:threshold' (e.g. 'token_k3:2.0', 'seq_mean_k1:0.5_2.0').

    Several entries are ANDed as in verl: lower bounds take the largest, upper bounds the smallest."""
    out: dict[str, float] = {}
    for entry in entries:
        name, sep, spec = entry.partition(":")
        name, spec = name.strip(), spec.strip()
        if name in NO_EQUIVALENT:
            raise ValueError(
                f"algo.rollout_rs={entry!r}: verl's {name} has no equivalent here: {NO_EQUIVALENT[name]}"
            )
        if name not in ALIASES:
            known = ", ".join([*ALIASES, *NO_EQUIVALENT])
            raise ValueError(
                f"algo.rollout_rs={entry!r}: unknown verl rejection name {name!r}; verl's are {known}"
            )
        if not sep or not spec:
            raise ValueError(
                f"algo.rollout_rs={entry!r} needs a threshold, as 'name:threshold' (e.g. 'token_k3:2.0')"
            )
        try:
            fields = ALIASES[name](spec)
        except ValueError as e:
            raise ValueError(f"algo.rollout_rs={entry!r}: {e}") from None
        for key, value in fields.items():
            out[key] = tighter(key, out.get(key), value)
    return out


def tighter(key: str, old: float | None, new: float) -> float:
    """The stricter of two bounds of config field `key` (a lower bound rises, an upper bound or a threshold
    falls)."""
    if old is None:
        return new
    return max(old, new) if key.endswith("_low") else min(old, new)
