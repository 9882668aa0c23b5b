"""The rollout cost model (`sparserl cost`): effective FLOPs = FLOPs + I x bytes moved for dense, eviction and
block-sparse rollouts, the memory each needs, and a probe of the hardware's FLOPs per byte I.
See docs/cost_model.md."""

from __future__ import annotations

from sparserl.cost.model import METHODS, Cost, Estimate, KVMethod, Rollout, cost_model, estimate
from sparserl.cost.probe import INTENSITY_PRESETS, probe_intensity, resolve_intensity
from sparserl.cost.shape import CostInputError, ModelShape, load_shape, shape_from_config

__all__ = [
    "INTENSITY_PRESETS",
    "METHODS",
    "Cost",
    "CostInputError",
    "Estimate",
    "KVMethod",
    "ModelShape",
    "Rollout",
    "cost_model",
    "estimate",
    "load_shape",
    "probe_intensity",
    "resolve_intensity",
    "shape_from_config",
]
