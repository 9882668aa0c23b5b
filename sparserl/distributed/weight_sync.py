"""How a policy version's trainable tensors reach the rollout workers (`distributed.weight_sync`).

- `object_store`: one `ray.put` of the tensors; each worker fetches its copy from the object store. No setup,
  and a replaced worker is simply sent the last version.
- `broadcast`: the trainer (rank 0) and the workers form one torch.distributed group, gloo on CPU and nccl where
  the workers hold GPUs (NCCL moves the tensors GPU to GPU, never through the host or the object store); a push
  is a few broadcasts from rank 0 in the names' order: each large tensor alone, runs of small ones packed into
  one buffer. A group cannot take in a new member: a replaced worker is sent the last version through the
  object store (the others may be decoding a share, and forming a group waits for every member), and the group
  is formed anew at the next push, between runs.

The group is a standalone process group on its own TCPStore (not torch.distributed's default group), so it
lives beside any other group the processes hold (the learner ranks', a user's), and forming it again is only
dropping the old object. Ray is handed in, never imported here.
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from sparserl.registry import Registry


def resolve_weight_sync(setting: str, gpus_per_worker: float) -> str:
    """`distributed.weight_sync`: auto is a broadcast where the workers hold GPUs, else the object store."""
    if setting != "auto":
        return setting
    return "broadcast" if gpus_per_worker > 0 else "object_store"


class WeightSync:
    """Sends versions to the workers: `push` to all of them, `catch_up` a worker that replaced worker `i`."""

    name: ClassVar[str] = ""

    def __init__(self, ray: Any, gpus_per_worker: float, timeout_s: float):
        self.ray, self.gpus_per_worker, self.timeout_s = ray, gpus_per_worker, timeout_s

    def push(self, workers: list[Any], version: int, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def catch_up(self, workers: list[Any], i: int, version: int, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a push failed (a worker died during it), before the next."""


WEIGHT_SYNCS: Registry[type[WeightSync]] = Registry("distributed.weight_sync")


@WEIGHT_SYNCS.register("object_store")
class ObjectStoreSync(WeightSync):
    def push(self, workers: list[Any], version: int, state: dict[str, torch.Tensor]) -> None:
        self.ref = self.ray.put(state)
        self.ray.get([w.push.remote(version, self.ref) for w in workers])

    def catch_up(self, workers: list[Any], i: int, version: int, state: dict[str, torch.Tensor]) -> None:
        self.ray.get(workers[i].push.remote(version, self.ref))


@WEIGHT_SYNCS.register("broadcast")
class BroadcastSync(WeightSync):
    group: Any = None

    @property
    def backend(self) -> str:
        return "nccl" if self.gpus_per_worker > 0 and torch.cuda.is_available() else "gloo"

    def form(self, workers: list[Any]) -> None:
        """A new group of this process (rank 0) and `workers` (ranks 1..W), on a store this process serves."""
        host = self.ray.util.get_node_ip_address()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        world, args = len(workers) + 1, (host, self.store.port, self.backend, self.timeout_s)
        joins = [w.join_weight_group.remote(*args, rank, world) for rank, w in enumerate(workers, start=1)]
        self.group = open_group(self.store, 0, world, self.backend, self.timeout_s)
        self.ray.get(joins)

    def push(self, workers: list[Any], version: int, state: dict[str, torch.Tensor]) -> None:
        if self.group is None:
            self.form(workers)
        sent = [(name, tensor.dtype) for name, tensor in state.items()]  # bf16 may travel to fp32 weights
        receives = [w.receive_weights.remote(version, sent) for w in workers]
        broadcast(self.group, list(state.values()), self.backend, rank=0)
        self.ray.get(receives)

    def reset(self) -> None:
        self.group = None  # a collective that failed leaves the group unusable: the next push forms a new one

    def catch_up(self, workers: list[Any], i: int, version: int, state: dict[str, torch.Tensor]) -> None:
        """The new worker alone, through the object store: forming a group now would wait (up to timeout_s)
        for the workers still decoding their shares. The next push, between runs, forms the group anew."""
        self.group = None
        self.ray.get(workers[i].push.remote(version, self.ray.put(state)))


def open_group(store: Any, rank: int, world: int, backend: str, timeout_s: float) -> Any:
    """A standalone process group over `store` (it returns once every rank has joined, or raises on timeout)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


def client_store(host: str, port: int, timeout_s: float) -> Any:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


# Small tensors travel packed into flat buckets of up to BUCKET_BYTES (one collective for many: a LoRA adapter's
# hundreds of small matrices); a tensor of PACK_BELOW bytes or more travels alone, in place where it can (packing
# it would cost a copy on every rank: measured 0.81 s against 0.42 s for SmolLM2 in fp32, benchmarks/ray_rollout.py).
BUCKET_BYTES = 64 * 2**20
PACK_BELOW = 2**20


def broadcast(
    group: Any, tensors: list[torch.Tensor], backend: str, rank: int, dtypes: list[torch.dtype] | None = None
) -> None:
    """Rank 0's `tensors` into the other ranks' tensors of the same shapes and order (in place), travelling in
    rank 0's `dtypes` (default: each tensor's own)."""
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    options = dist.BroadcastOptions()
    options.rootRank = 0
    for dtype, members in buckets(tensors, dtypes or [t.dtype for t in tensors]):
        alone = members[0].detach()
        # a lone tensor already on the device, in that dtype and contiguous travels (or is received) in place
        in_place = (
            len(members) == 1
            and alone.device.type == device.type
            and alone.dtype == dtype
            and alone.is_contiguous()
        )
        if in_place:
            flat = alone
        elif rank == 0:
            flat = torch.cat([t.detach().reshape(-1).to(device, dtype) for t in members])
        else:
            flat = torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)
        group.broadcast([flat], options).wait()
        if rank != 0 and not in_place:
            with torch.no_grad():
                for tensor, part in zip(members, flat.split([t.numel() for t in members]), strict=True):
                    tensor.copy_(part.view_as(tensor))


def buckets(tensors: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[tuple[torch.dtype, list]]:
    """Runs of consecutive small tensors of one travelling dtype, cut before BUCKET_BYTES; large ones alone."""
    out: list[tuple[torch.dtype, list]] = []
    packing, size = False, 0  # whether out[-1] is a bucket small tensors may still join, and its bytes
    for tensor, dtype in zip(tensors, dtypes, strict=True):
        nbytes = tensor.numel() * dtype.itemsize
        if nbytes >= PACK_BELOW:
            out.append((dtype, [tensor]))
            packing = False
            continue
        if not packing or out[-1][0] != dtype or size + nbytes > BUCKET_BYTES:
            out.append((dtype, []))
            packing, size = True, 0
        out[-1][1].append(tensor)
        size += nbytes
    return out
