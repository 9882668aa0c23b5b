"""Ray started or joined for a run (`distributed.ray_address`): an unreachable cluster named within seconds, the
process's SIGTERM handler kept, the run's actors in one namespace."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from sparserl.errors import ClusterError

NAMESPACE = "sparserl"  # the runs' actors (a swarm's pool) are found by name within it


@contextlib.contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """`ray.init` installs its own SIGTERM handler in the driver and leaves it after shutdown; a run's own (save
    the step, exit 143: sparserl/signals.py) is put back."""
    main = threading.current_thread() is threading.main_thread()
    saved = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main and saved is not None:
            signal.signal(signal.SIGTERM, saved)


def init_ray(ray: Any, cfg: Any) -> None:
    """A local Ray (empty `ray_address`) or the cluster at the address; an unreachable one is a ClusterError
    naming it within seconds (`check_reachable`). The process's SIGTERM handler is kept."""
    where = f"the Ray cluster at distributed.ray_address={cfg.ray_address!r}" if cfg.ray_address else "Ray"
    try:
        if cfg.ray_address:
            check_reachable(cfg.ray_address, min(CONNECT_TIMEOUT_S, cfg.start_timeout_s))
            with keep_signal_handlers():
                ray.init(
                    address=cfg.ray_address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False
                )
        else:
            with keep_signal_handlers():
                ray.init(num_cpus=max(cfg.local_ray_cpus(), 1), namespace=NAMESPACE, include_dashboard=False,
                         logging_level="ERROR", log_to_driver=False, object_store_memory=512 * 2**20)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"could not start or reach {where}: {e}") from None


CONNECT_TIMEOUT_S = (
    10.0  # seconds a connection to distributed.ray_address may take (Ray itself waits minutes)
)


def check_reachable(address: str, timeout_s: float) -> None:
    """A `host:port` address (also `ray://host:port`) that takes no TCP connection within `timeout_s` is a
    ConnectionError now, where ray.init would retry for minutes; other forms ('auto') are Ray's to resolve."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except OSError as e:
        raise ConnectionError(
            f"nothing answers at {address} ({e.strerror or e}; waited {timeout_s:g} s at most)"
        ) from None
