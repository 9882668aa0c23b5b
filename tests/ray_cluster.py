"""A local 2-CPU Ray for a test module (`from tests.ray_cluster import local_ray`): started once per module,
with the process's SIGTERM handler kept (sparserl/distributed/cluster.py), shut down after."""

from __future__ import annotations

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
