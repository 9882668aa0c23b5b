"""Checks of a training config against its model's shape (read from the model's config, no weights), made
before a run directory exists: a rollout longer than the model's context, a KV memory cap below one sequence."""

from __future__ import annotations

from sparserl.config.errors import ConfigError
from sparserl.config.sections import TrainConfig
from sparserl.errors import UserError


def check_fits_model(cfg: TrainConfig) -> None:
    """ConfigError naming the setting when rollout.max_new_tokens leaves no room for a prompt in the model's
    context, or rollout.kv_memory_cap cannot hold a single sequence's first step (so the run would fail at its
    first rollout). A model whose config cannot be read here (a Hub id not downloaded yet, a bad path) is left
    to the trainer, which loads it and names what is wrong."""
    from sparserl.cost.shape import load_model_config, shape_from_config
    from sparserl.engine.allocation import CAPACITY_BUCKET  # a capped cache grows in blocks of this many

    try:
        config = load_model_config(cfg.model.spec)
        shape = shape_from_config(config, cfg.model.spec, cfg.model.dtype)
    except UserError:
        return
    max_new = cfg.rollout.max_new_tokens
    context = getattr(config, "max_position_embeddings", None)
    if context and max_new >= context:
        raise ConfigError(
            f"rollout.max_new_tokens={max_new} leaves no room for a prompt in the model's context of "
            f"{context} positions ({cfg.model.spec}); set it below {context}"
        )
    cap = cfg.rollout.kv_memory_cap_bytes
    if cap is None:
        return
    # The fewest positions the engine charges a sequence at its first step: at least the prompt (>= 1 token)
    # plus one, grown in whole blocks unless an evicting cache's bound (budget + interval - 1) is smaller.
    evicting = cfg.sparse and cfg.kv.evicting
    bound = cfg.kv.max_budget + cfg.kv.interval - 1 if evicting else CAPACITY_BUCKET
    positions = min(1 + max_new, bound)
    need = positions * shape.kv_bytes_per_position
    if cap < need:
        raise ConfigError(
            f"rollout.kv_memory_cap={cfg.rollout.kv_memory_cap} ({cap:,} bytes) is below one sequence: "
            f"{cfg.model.spec} holds {shape.kv_bytes_per_position:,} bytes of KV per position in "
            f"{cfg.model.dtype}, and a sequence's first step is charged at least {positions} positions "
            f"({need:,} bytes); raise the cap or unset it"
        )
