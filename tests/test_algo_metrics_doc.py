"""Every metric the algorithm logs has its line in docs/metrics.md, and the doc lists no stale algo metric."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from sparserl.algo import algo_config, correction_weights, policy_loss

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def emitted() -> set[str]:
    cfg = algo_config(
        "sparse-rl",
        icepop_low=0.5,
        icepop_high=5.0,
        seq_mis_low=0.5,
        seq_mis_high=2.0,
        geo_rs_low=0.5,
        geo_rs_high=2.0,
        k3_rs_threshold=0.01,
        prob_diff_threshold=0.2,
        prefix_rs_low=0.5,
        prefix_rs_high=2.0,
        sampler_kl_coef=0.1,
        outlier_token_is_threshold_low=1e-4,
        outlier_token_is_threshold_high=100.0,
        off_policy_mask_threshold=0.5,
        top_entropy_quantile=0.5,
    )
    g = torch.Generator().manual_seed(0)
    old, samp = -torch.rand(2, 3, generator=g), -torch.rand(2, 3, generator=g)
    w, keep, m1 = correction_weights(old, samp, torch.ones(2, 3), cfg, advantages=torch.ones(2))
    _, m2 = policy_loss(
        old, old, torch.ones(2), keep, w, cfg, logp_ref=samp, entropy=torch.rand(2, 3), logp_sampler=samp
    )
    return set(m1) | set(m2)


def test_every_logged_metric_is_documented_once():
    text = DOC.read_text()
    documented = re.findall(r"^- `((?:rollout_corr|actor)/[a-z0-9_]+)` - ", text, flags=re.M)
    assert len(documented) == len(set(documented)), "a metric is documented twice"
    names = emitted()
    assert names - set(documented) == set(), "undocumented metrics"
    assert set(documented) - names == set(), "documented metrics the algorithm no longer logs"
