"""The range checks of AlgoConfig's numeric fields, one ValueError naming the key each (kept apart from the
dataclass so that its fields and their help stay readable)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: config.py calls check_ranges
    from sparserl.algo.config import AlgoConfig

# (lower, upper) bounds of a kept ratio: each >= 0, lower <= upper
RATIO_BOUNDS = (
    ("token_rs_low", "token_rs_high"),
    ("icepop_low", "icepop_high"),
    ("seq_mis_low", "seq_mis_high"),
    ("geo_rs_low", "geo_rs_high"),
    ("prefix_rs_low", "prefix_rs_high"),
    ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
)


def check_ranges(cfg: AlgoConfig) -> None:
    """Raise ValueError for the first field of `cfg` outside its range."""
    _ratio_bounds(cfg)
    _loss_ranges(cfg)
    if cfg.overlong_buffer < 0 or cfg.overlong_penalty < 0:
        raise ValueError(
            f"algo.overlong_buffer={cfg.overlong_buffer} and algo.overlong_penalty={cfg.overlong_penalty} "
            "must be >= 0"
        )
    if cfg.loss_token_norm is not None and cfg.loss_token_norm < 1:
        raise ValueError(f"algo.loss_token_norm={cfg.loss_token_norm} must be >= 1")
    if cfg.veto_threshold is not None and not 0 < cfg.veto_threshold < 1:
        raise ValueError(f"algo.veto_threshold={cfg.veto_threshold} must be in (0, 1)")
    for key in ("k3_rs_threshold", "prob_diff_threshold"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 0:
            raise ValueError(f"algo.{key}={getattr(cfg, key)} must be >= 0")
    if cfg.adv_eps < 0 or cfg.batch_norm_min < 0:
        raise ValueError("algo.adv_eps and algo.batch_norm_min must be >= 0")
    if cfg.tis_cap is not None and cfg.tis_cap <= 0:
        raise ValueError(f"algo.tis_cap={cfg.tis_cap} must be > 0")
    if cfg.seq_tis_cap is not None and cfg.seq_tis_cap <= 0:
        raise ValueError(f"algo.seq_tis_cap={cfg.seq_tis_cap} must be > 0")
    if cfg.log_ratio_clamp <= 0 or cfg.kl_clamp <= 0:
        raise ValueError("algo.log_ratio_clamp and algo.kl_clamp must be > 0")


def _ratio_bounds(cfg: AlgoConfig) -> None:
    for lo, hi in RATIO_BOUNDS:
        a, b = getattr(cfg, lo), getattr(cfg, hi)
        if a is not None and b is not None and a > b:
            raise ValueError(f"algo.{lo}={a} must be <= algo.{hi}={b}")
        for name, v in ((lo, a), (hi, b)):
            if v is not None and v < 0:
                raise ValueError(f"algo.{name}={v} must be >= 0 (it bounds a ratio)")


def _loss_ranges(cfg: AlgoConfig) -> None:
    if cfg.entropy_coef < 0:
        raise ValueError(f"algo.entropy_coef={cfg.entropy_coef} must be >= 0 (it is a bonus)")
    if cfg.eps_low < 0 or cfg.eps_high < 0:
        raise ValueError(f"algo.eps_low={cfg.eps_low} and algo.eps_high={cfg.eps_high} must be >= 0")
    if cfg.eps_low >= 1:
        raise ValueError(f"algo.eps_low={cfg.eps_low} must be < 1 (the lower clip is 1 - eps_low)")
    if cfg.dual_clip_c is not None and cfg.dual_clip_c <= 1:
        raise ValueError(f"algo.dual_clip_c={cfg.dual_clip_c} must be > 1")
    for key in ("kl_coef", "sampler_kl_coef", "ppo_kl_coef"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"algo.{key}={getattr(cfg, key)} must be >= 0")
    for key in ("clip_cov_ratio", "kl_cov_ratio", "top_entropy_quantile"):
        if not 0 < getattr(cfg, key) <= 1:
            raise ValueError(f"algo.{key}={getattr(cfg, key)} must be in (0, 1] (a share of the tokens)")
    if cfg.clip_cov_lb >= cfg.clip_cov_ub:
        raise ValueError(f"algo.clip_cov_lb={cfg.clip_cov_lb} must be < algo.clip_cov_ub={cfg.clip_cov_ub}")
    if cfg.tau_pos <= 0 or cfg.tau_neg <= 0:
        raise ValueError(f"algo.tau_pos={cfg.tau_pos} and algo.tau_neg={cfg.tau_neg} must be > 0")
