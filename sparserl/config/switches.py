"""Settings of a feature that is off do nothing: a key the user set (its value differs from the default) under a
switch that is off is refused, naming the key and the switch that turns its feature on, as `algo` refuses
corrections under algo.correction_mode=none. Defaults are never refused, so a saved config loads again."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from sparserl.config.errors import ConfigError

if TYPE_CHECKING:  # the config's type only: checks.py calls this
    from sparserl.config.sections import TrainConfig


def set_keys(section: Any, prefix: str, names: tuple[str, ...] | None = None) -> list[str]:
    """'prefix.name=value' for each field of the dataclass `section` (those in `names`, else all but `enable`)
    whose value differs from the field's default: the keys a user set."""
    out = []
    for f in dataclasses.fields(section):
        if (f.name not in names) if names is not None else f.name == "enable":
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        value = getattr(section, f.name)
        if value != default:
            out.append(f"{prefix}.{f.name}={value}")
    return out


def _prefixed(section: Any, start: str) -> tuple[str, ...]:
    """The names of `section`'s fields that start with `start`."""
    return tuple(f.name for f in dataclasses.fields(section) if f.name.startswith(start))


def check_switches(cfg: TrainConfig) -> None:
    """Refuse the keys set for a feature that is off (ConfigError naming them and the switch)."""
    s, r, d = cfg.sampling, cfg.rollout, cfg.distributed
    transforms = cfg.algo.adv_transforms
    tree_advantages = [f"algo.adv_transforms=[{', '.join(transforms)}]"] if "tree" in transforms else []
    rules = [
        (s.method != "dars", set_keys(s, "sampling", _prefixed(s, "dars_")), "sampling.method=dars"),
        (s.method != "vcrl", set_keys(s, "sampling", _prefixed(s, "vcrl_")), "sampling.method=vcrl"),
        (not r.spec.enable, set_keys(r.spec, "rollout.spec"), "rollout.spec.enable=true"),
        (not r.tree.enable, set_keys(r.tree, "rollout.tree") + tree_advantages, "rollout.tree.enable=true"),
        (not r.partial.enable, set_keys(r.partial, "rollout.partial"), "rollout.partial.enable=true"),
        (
            cfg.shaping.method == "none",
            set_keys(cfg.shaping, "shaping", ("alpha", "mode", *_prefixed(cfg.shaping, "judge"))),
            "shaping.method=uniqueness",
        ),
        (
            cfg.algo.overlong_buffer == 0,
            set_keys(cfg.algo, "algo", ("overlong_penalty",)),
            "algo.overlong_buffer > 0",
        ),
        (
            not d.rollout_workers,
            set_keys(d, "distributed", ("weight_sync",)),
            "distributed.rollout_workers > 0",
        ),
    ]
    for off, keys, switch in rules:
        if off and keys:
            one = len(keys) == 1
            raise ConfigError(
                f"{', '.join(keys)} {'applies' if one else 'apply'} only with {switch}, which is off: set "
                f"{switch} to use {'it' if one else 'them'}, or leave {'it' if one else 'them'} unset"
            )
