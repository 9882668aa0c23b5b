"""The weight syncs' registry and the bucketed broadcast (sparserl/distributed/weight_sync.py) without Ray: two
processes in a gloo group; the Ray backend's use of them is in tests/test_ray_backend.py."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from sparserl.config import ConfigError, load_config
from sparserl.config.distributed import WEIGHT_SYNC_CHOICES
from sparserl.distributed import weight_sync
from sparserl.distributed.weight_sync import WEIGHT_SYNCS, broadcast, buckets, open_group, resolve_weight_sync
from sparserl.errors import UserError


def test_weight_sync_choices_are_the_registry_and_a_wrong_one_is_named():
    assert set(WEIGHT_SYNC_CHOICES) == {"auto", *WEIGHT_SYNCS}
    assert (
        resolve_weight_sync("auto", 0.0) == "object_store" and resolve_weight_sync("auto", 1.0) == "broadcast"
    )
    with pytest.raises(ConfigError, match="distributed.weight_sync='nccl': choose one of auto, object_store"):
        load_config(None, ["distributed.weight_sync=nccl"])
    with pytest.raises(
        UserError, match="distributed.weight_sync='nccl' is unknown; choose one of object_store"
    ):
        WEIGHT_SYNCS.lookup("nccl")  # what a backend built without the config's check would say


def test_buckets_are_runs_of_small_tensors_of_one_dtype_cut_at_the_size(monkeypatch):
    monkeypatch.setattr(weight_sync, "BUCKET_BYTES", 40)
    monkeypatch.setattr(weight_sync, "PACK_BELOW", 64)
    f32, bf16 = torch.float32, torch.bfloat16
    sizes = [(4, f32), (4, f32), (4, f32), (2, bf16), (30, bf16), (20, f32), (4, f32)]  # 20 x 4 B: alone
    got = buckets([torch.zeros(n) for n, _ in sizes], [d for _, d in sizes])
    assert [(d, [t.numel() for t in members]) for d, members in got] == [
        (f32, [4, 4]), (f32, [4]), (bf16, [2]), (bf16, [30]), (f32, [20]), (f32, [4])
    ]  # fmt: skip


def tensors(rank: int) -> list[torch.Tensor]:
    """Rank 0's values, or zeros of the same shapes (two non-contiguous) on the other ranks."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g), torch.randn(4, 2, generator=g)]
    values.append(torch.randn(512, 513, generator=g))  # over PACK_BELOW: travels alone
    zeros = [torch.zeros(3, 5), torch.zeros(7), torch.zeros(2, 4).t(), torch.zeros(513, 512).t()]
    return values if rank == 0 else zeros


def member(rank: int, port: int, dtypes: list[torch.dtype], out) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=datetime.timedelta(seconds=30))
    group = open_group(store, rank, 2, "gloo", 30.0)
    got = tensors(rank)
    broadcast(group, got, "gloo", rank, dtypes)
    # numpy copies travel by value: a tensor would be sent as a handle to this process's shared memory, which
    # is gone if the process exits before the test has read it
    out.put((rank, [t.numpy().copy() for t in got]))


@pytest.mark.parametrize("travel", ["float32", "mixed"])
def test_the_broadcast_fills_every_tensor_in_place(travel):
    """Values arrive in each receiving tensor, packed or alone, contiguous or not; bfloat16 legs round."""
    f32, bf16 = torch.float32, torch.bfloat16
    dtypes = [f32] * 4 if travel == "float32" else [f32, bf16, f32, bf16]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, port, dtypes, out)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    got = {
        rank: [torch.from_numpy(a) for a in arrays] for rank, arrays in (out.get(timeout=120) for _ in procs)
    }
    for proc in procs:
        proc.join(timeout=30)
        proc.kill()  # a member left waiting (a failed run) does not outlive the test
    for sent, received, dtype in zip(tensors(0), got[1], dtypes, strict=True):
        assert torch.equal(received, sent.to(dtype).float())
    assert all(torch.equal(a, b) for a, b in zip(got[0], tensors(0), strict=True))  # the root's own unchanged
