"""The algorithm half: advantages, Sparse-RL corrections, the policy loss (tensors in, tensors and metrics out)."""

from sparserl.algo.config import AlgoConfig
from sparserl.algo.presets import PRESETS, algo_config

__all__ = ["PRESETS", "AlgoConfig", "algo_config"]
