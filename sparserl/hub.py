"""The Hugging Face Hub, asked only when it answers. Without a network, transformers, huggingface_hub and datasets
each retry for up to a minute before saying they could not connect; one quick connection to the Hub's host
tells at once, and where it fails this process reads the local caches only (as with HF_HUB_OFFLINE=1), so a
model or dataset that is cached still loads and one that is not fails within seconds, with a clear message."""

from __future__ import annotations

import functools
import os
import socket
import sys
from urllib.parse import urlparse

PROBE_TIMEOUT = 3.0  # seconds the connection to the Hub's host may take
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")  # the proxy decides: not probed


def hub_host() -> str:
    """The Hub's host name ($HF_ENDPOINT's, else huggingface.co), for messages."""
    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT


def hub_offline() -> bool:
    """Whether this process reads the Hub's local caches only: HF_HUB_OFFLINE is set, or (no proxy set) a
    connection to the Hub's host failed within PROBE_TIMEOUT seconds, which switches offline mode on here."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return True
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return False
    return probe_failed()


@functools.lru_cache(maxsize=1)
def probe_failed() -> bool:
    """Whether a connection to the Hub's host fails (tried once per process); if so, offline mode is on."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection(
            (url.hostname or "", url.port or (80 if url.scheme == "http" else 443)), PROBE_TIMEOUT
        ).close()
        return False
    except OSError:
        pass
    os.environ["HF_HUB_OFFLINE"] = "1"  # read by datasets when it is imported later
    constants.HF_HUB_OFFLINE = True  # read at each call by huggingface_hub and transformers
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
    return True


def unreachable(what: str) -> str:
    """The words for a Hub `what` ('model 'owner/name'') that is not cached while the Hub cannot be reached."""
    return (
        f"{what} is not in the local Hugging Face cache and the Hub ({hub_host()}) cannot be reached "
        "(no network?)"
    )
