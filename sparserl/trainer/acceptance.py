"""Training-time logging of the acceptance rate alpha (trainer.log_acceptance): the rollout records the sampler's
top-k (and full) distributions, the dense policy is scored on the same prefixes, and the step logs alpha's tail
per bin of absolute position (docs/metrics.md, "Acceptance rate"). Nothing is recorded or scored when off."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from sparserl.algo.acceptance import acceptance_metrics
from sparserl.config import ConfigError
from sparserl.engine.acceptance import rollout_acceptance
from sparserl.engine.rollout import Sample


def check_acceptance(cfg: Any, vocab_size: int) -> None:
    """Refuse at start-up, not at the first rollout, a top-k larger than the model's vocabulary."""
    if cfg.trainer.log_acceptance and cfg.trainer.acceptance_top_k > vocab_size:
        raise ConfigError(
            f"trainer.acceptance_top_k={cfg.trainer.acceptance_top_k} exceeds the vocabulary of "
            f"{cfg.model.spec!r} ({vocab_size} tokens)"
        )


def acceptance_request(cfg: Any) -> dict[str, Any]:
    """The `generate` keywords that make the sampler record what alpha needs (none when logging is off)."""
    t = cfg.trainer
    if not t.log_acceptance:
        return {}
    return {"top_logprobs": t.acceptance_top_k, "full_logprobs": t.acceptance_exact}


def acceptance_step_metrics(
    cfg: Any, model: nn.Module, prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sample]
) -> dict[str, float]:
    """alpha of the step's rollouts against the dense policy `model` (before the update), binned by absolute
    position: `alpha/<topk|exact>/<p5|p1|mean|frac_below_tau>/bin<i>`, `alpha/tokens/bin<i>` and
    `time/acceptance`; {} when trainer.log_acceptance is off."""
    if not cfg.trainer.log_acceptance:
        return {}
    t0 = time.perf_counter()
    r = cfg.rollout
    alpha = rollout_acceptance(model, prompt_ids, samples, r.temperature, r.top_p, r.top_k)
    metrics = acceptance_metrics(alpha.binned(cfg.trainer.acceptance_bin, cfg.trainer.acceptance_tau))
    metrics["time/acceptance"] = time.perf_counter() - t0
    return metrics
