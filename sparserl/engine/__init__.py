"""The rollout engine: our decoder forward, a preallocated KV cache (dense, evicting, or read block-sparse),
sampling, scoring."""

from __future__ import annotations

from sparserl.engine.kv_config import EVICTION_METHODS, SELECTORS, KVConfig, kv_methods
from sparserl.engine.rollout import RolloutEngine, Rollouts, Sample
from sparserl.engine.sampling import TokenDistributions
from sparserl.engine.scoring import completion_logprobs, redraw, score, score_distributions

__all__ = [
    "EVICTION_METHODS",
    "SELECTORS",
    "KVConfig",
    "RolloutEngine",
    "Rollouts",
    "Sample",
    "TokenDistributions",
    "completion_logprobs",
    "kv_methods",
    "redraw",
    "score",
    "score_distributions",
]
