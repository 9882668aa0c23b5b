"""Where a run's actors go: a request checked against the cluster's total resources before any waiting, the
free resources an error names, and gang scheduling (a placement group: all the bundles at once or none)."""

from __future__ import annotations

from typing import Any

from sparserl.errors import ClusterError


def check_schedulable(ray: Any, count: int, cpus: float, gpus: float, what: str, key: str) -> None:
    """`count` actors of `cpus` CPUs and `gpus` GPUs each fit the cluster's total resources (free or not), or a
    ClusterError naming them now rather than after distributed.start_timeout_s of waiting for them."""
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    if count * cpus <= total.get("CPU", 0) + 1e-9 and count * gpus <= total.get("GPU", 0) + 1e-9:
        return
    raise ClusterError(
        f"{count} {what} cannot all be placed: each asks for {cpus:g} CPUs and {gpus:g} GPUs, and the Ray cluster "
        f"has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all (lower {key} or the "
        "per-actor resources)"
    )


def free_resources(ray: Any) -> dict[str, float]:
    """The cluster's free CPUs, GPUs and memory, without the placement groups' internal entries."""
    return {k: v for k, v in ray.available_resources().items() if "_group_" not in k}


def gang(count: int, cpus: float, gpus: float) -> Any:
    """A placement group of `count` bundles of `cpus` CPUs (and `gpus` GPUs), packed: reserved all at once."""
    from ray.util.placement_group import placement_group

    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    return placement_group([bundle] * count, strategy="PACK")


def placed(ray: Any, group: Any, timeout_s: float) -> bool:
    """Whether every bundle of `group` was reserved within `timeout_s`."""
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    return bool(ready)


def in_bundle(group: Any, index: int) -> Any:
    """The scheduling strategy that puts an actor in bundle `index` of `group` (`.options(scheduling_strategy=)`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def remove(group: Any) -> None:
    """Free `group`'s reserved resources."""
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)
