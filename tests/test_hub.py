"""A Hub model or dataset while the Hub cannot be reached: one quick connection attempt tells, the process reads
the local caches only, and what is not cached fails at once with a message saying why (no minute of retries)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from huggingface_hub import constants

from sparserl import hub
from sparserl.errors import DataError
from sparserl.models import ModelLoadError, load_model
from sparserl.tasks import TaskConfig, make_task

UNREACHABLE = r"not in the local Hugging Face cache and the Hub \(huggingface\.co\) cannot be reached"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """No connection succeeds (the attempts are recorded); the Hub's offline switches are restored after."""
    tried: list = []

    def refuse(address: tuple, *args: object, **kwargs: object) -> socket.socket:
        tried.append(address)
        raise OSError("Network is unreachable")

    for name in (*hub.PROXY_VARIABLES, "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # restored (unset) after: the probe sets it
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://huggingface.co")
    monkeypatch.setattr(socket, "create_connection", refuse)
    datasets_config = pytest.importorskip("datasets.config")
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", False)
    hub.probe_failed.cache_clear()
    yield tried
    hub.probe_failed.cache_clear()


def test_a_hub_model_not_cached_fails_at_once_saying_the_hub_is_unreachable(no_network: list) -> None:
    with pytest.raises(ModelLoadError, match=r"model 'someone/not-a-cached-model' is " + UNREACHABLE):
        load_model("someone/not-a-cached-model")
    assert no_network == [("huggingface.co", 443)] and constants.HF_HUB_OFFLINE and hub.hub_offline()


def test_a_hub_dataset_not_cached_fails_at_once_saying_the_hub_is_unreachable(no_network: list) -> None:
    with pytest.raises(
        DataError, match=r"'someone/not-a-dataset' is not a local .*, and .*it is " + UNREACHABLE
    ):
        make_task(TaskConfig(name="someone/not-a-dataset"))
    assert no_network == [("huggingface.co", 443)]
