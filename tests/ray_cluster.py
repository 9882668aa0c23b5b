"""A local 2-CPU Ray for a test module (`from tests.ray_cluster import local_ray, ray_cpus_free`): started once
per module, with the process's SIGTERM handler kept (sparserl/distributed/cluster.py), shut down after; each
test starts once the cluster has its CPUs back from the previous test's actors."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray = pytest.importorskip("ray")
    from sparserl.distributed.cluster import keep_signal_handlers

    with keep_signal_handlers():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                 object_store_memory=256 * 2**20)  # fmt: skip
    yield
    with keep_signal_handlers():
        ray.shutdown()


@pytest.fixture(autouse=True)
def ray_cpus_free(local_ray):
    """Wait (up to 180 s) until both CPUs are free: Ray gives an ended actor's CPU back asynchronously, which a
    busy machine can delay past the next test's start (its workers then could not be placed; seen after 60 s
    with another job on the second core)."""
    import ray

    deadline = time.monotonic() + 180
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    yield
