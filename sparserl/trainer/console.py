"""What `sparserl train` says on the console beyond the progress bar: a header naming every system the run has
on, the one number each of them changes on the step line, and the notes a user needs once (SPEC-RL idle until
a prompt returns, evaluation at its own temperature). Pure functions of the config and a step's metrics."""

from __future__ import annotations

from typing import Any

from sparserl.engine.kv_config import DENSE


def kv_text(cfg: Any) -> str:
    """The sampler's cache in words: 'dense' when rollouts are sampled dense, else `KVConfig.describe()`."""
    return cfg.kv.describe() if cfg.sparse else DENSE


def own_source(sampling: Any) -> bool:
    """Whether sampling.method is other than the config's default (plain prompts, one round)."""
    return sampling.method != type(sampling).method  # a dataclass field's default is its class attribute


def active_systems(cfg: Any) -> list[str]:
    """Every system beyond plain GRPO sampling that the run has on, in words, in the order they act."""
    s, r, d = cfg.sampling, cfg.rollout, cfg.distributed
    on = {
        f"sampling {s.method}": own_source(s),
        "dynamic sampling": s.dynamic,
        f"tree rollouts ({r.tree.rounds} rounds x {r.tree.forks} forks x {r.tree.children} children)": (
            r.tree.enable
        ),
        "SPEC-RL reuse": r.spec.enable,
        f"partial rollouts (max staleness {r.partial.max_staleness})": r.partial.enable,
        f"KV memory cap {r.kv_memory_cap}": r.kv_memory_cap is not None,
        f"shaping {cfg.shaping.method}": cfg.shaping.method != "none",
        "DistillSparse": cfg.distill.enable,
        f"{d.rollout_workers} Ray rollout workers": d.rollout_workers > 0,
        f"{d.learners} learners" + (" (FSDP)" if d.fsdp else ""): d.learners > 1 or d.fsdp,
        f"SAPO swarm (node {d.swarm.node})": d.swarm.enable,
    }
    return [name for name, enabled in on.items() if enabled]


def header(cfg: Any, run_dir: Any) -> str:
    """The line `sparserl train` starts with: where the run goes, what it trains, how, with which systems."""
    systems = active_systems(cfg)
    return (
        f"[bold]sparserl train[/bold] -> {run_dir}  (model {cfg.model.spec}, task {cfg.task.name}, "
        f"algo {cfg.algo.preset} (loss {cfg.algo.policy_loss}), rollouts {kv_text(cfg)}, "
        f"{cfg.trainer.steps} steps x {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.n})"
        + (f"\nsystems on: {', '.join(systems)}" if systems else "")
    )


def notes(cfg: Any) -> list[str]:
    """What a user should know once, before the first step, to read the numbers that follow."""
    out = []
    if cfg.rollout.spec.enable:
        out.append(
            "SPEC-RL reuses a prompt's previous samples only when that prompt comes back (a later epoch): "
            "until then every sample is drawn afresh (reused 0%)"
        )
    if cfg.trainer.eval_prompts > 0 and cfg.trainer.eval_temperature != cfg.rollout.temperature:
        out.append(
            f"evaluation samples at temperature {cfg.trainer.eval_temperature:g} (trainer.eval_temperature), "
            f"training at {cfg.rollout.temperature:g} (rollout.temperature): eval and train rewards differ"
        )
    return out


def step_numbers(cfg: Any, m: dict[str, Any]) -> str:
    """The step line's extra numbers: the sampler's entropy estimate, and the one number each active system
    changes (SPEC-RL's reused share, extra samples drawn, tree leaves, staleness, ...)."""
    s, r, d = cfg.sampling, cfg.rollout, cfg.distributed
    parts = [f"H {m['rollout/entropy_estimate']:.2f}"] if "rollout/entropy_estimate" in m else []
    if own_source(s) or s.dynamic:
        base = r.prompts_per_step * r.n
        parts.append(f"+{max(0.0, m.get('sampling/generated_samples', base) - base):.0f} samples")
    if r.tree.enable:
        parts.append(f"leaves {m.get('sampling/tree_leaves', 0.0):.0f}")
    if r.spec.enable:
        reused = m.get("sampling/spec_reused_tokens", 0.0)
        share = reused / max(1.0, reused + m.get("sampling/generated_tokens", 0.0))
        parts.append(f"reused {share:.0%}")
    if r.partial.enable or d.rollout_workers > 0:
        parts.append(f"stale {m.get('rollout/staleness_mean', 0.0):.1f}")
    if cfg.shaping.method != "none" and "shaping/clusters_per_group" in m:
        parts.append(f"clusters {m['shaping/clusters_per_group']:.1f}")
    if cfg.distill.enable and "distill/tv" in m:
        parts.append(f"distill tv {m['distill/tv']:.3f}")
    if d.swarm.enable:
        parts.append(f"swarm {m.get('sampling/swarm_external_groups', 0.0):.0f} groups")
    return "  ".join(parts)
