"""Data-parallel learners (`distributed.learners` > 1): N Ray actors, gang-scheduled in a placement group, each
with a copy of the policy and the usual `Learner`.

Each rank runs its share of every mini-batch's micro-batches (`rank::N`: the very micro-batches one learner
would run, so per-micro-batch corrections see the same rows), then before each optimizer step the ranks agree
on whether every micro-batch was finite, on the loss denominator and the metric sums, and sum their gradients
(torch.distributed: gloo on CPU, nccl on GPU). Every rank then takes the same step, or skips it, together.
With `distributed.fsdp` each rank holds a shard of the policy instead of a copy (trainer/sharding.py).

The trainer stays the single controller: `LearnerGroup` has the local learner's interface (`update`,
`optimizer`, `scheduler`), so the loop does not know which it has. After an update rank 0's weights are copied
into the trainer's policy (the rollouts and the next scoring read them) and its optimizer state is fetched
when a checkpoint reads `optimizer`: checkpoints have the one-learner format, and a resume loads them into any
number of ranks. Ray is imported only when a group is built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, NoReturn

import torch
from torch import Tensor

from sparserl.config import ConfigError, TrainConfig
from sparserl.distributed import placement
from sparserl.distributed.cluster import init_ray
from sparserl.distributed.weights import load_named
from sparserl.engine.weights import bump_weights_version
from sparserl.errors import ClusterError
from sparserl.process_memory import actor_peaks, peak_rss_bytes
from sparserl.trainer import sharding
from sparserl.trainer.completions import SampleStats
from sparserl.trainer.policy import autocast_for
from sparserl.trainer.update import Batch, Learner, SingleProcess


def make_learner(
    cfg: TrainConfig,
    module: torch.nn.Module,
    params: list[torch.nn.Parameter],
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> Learner | LearnerGroup:
    """The run's learner: in this process, or a group of `distributed.learners` ranks."""
    group = cfg.distributed.learner_ranks > 0
    return (LearnerGroup if group else Learner)(cfg, module, params, autocast)


class TorchCollective(SingleProcess):
    """One rank's view of the group, over the default torch.distributed process group."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def mine(self, micros: list[Tensor]) -> list[Tensor]:
        return micros[self.rank :: self.world]

    def agree(self, finite: bool, denominator: float, parts: dict[str, float]) -> tuple[bool, float, dict]:
        import torch.distributed as dist

        shares: list[Any] = [None] * self.world
        dist.all_gather_object(shares, (finite, denominator, parts))
        merged: dict[str, float] = {}
        for _, _, share in shares:
            for k, v in share.items():
                merged[k] = merged.get(k, 0.0) + v
        return all(s[0] for s in shares), sum(s[1] for s in shares), merged

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """One all-reduce over the gradients flattened into a buffer (a rank without one sends zeros)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(summed)

    def merge_rows(self, rows: Tensor, owned: Tensor) -> Tensor:
        """Each row comes from the one rank that owned it: the others add zeros (x + 0 is exact)."""
        import torch.distributed as dist

        shown = owned.view(-1, *([1] * (rows.dim() - 1)))
        mine = torch.where(shown, rows, torch.zeros_like(rows))
        dist.all_reduce(mine)
        return mine


class ShardedCollective(TorchCollective):
    """A rank of sharded learners (trainer/sharding.py): FSDP sums the gradients inside each backward."""

    lockstep = True

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Already summed: every backward reduce-scattered its gradients into each rank's shard."""


class LearnerRank:
    """One Ray actor: a policy copy (or, with distributed.fsdp, its shard) and a `Learner` that runs its share
    of each mini-batch; the learner is built once the rank has joined the process group."""

    def __init__(self, cfg: TrainConfig, module: torch.nn.Module, names: list[str], rank: int, world: int):
        d = cfg.distributed
        torch.set_num_threads(max(1, int(d.cpus_per_learner)))
        self.device = torch.device("cuda" if d.gpus_per_learner > 0 else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray shows each rank its own GPU
        self.module, self.names, self.rank, self.world = module.to(self.device), names, rank, world
        self.cfg, self.sharded = cfg, d.fsdp
        self.learner: Learner | None = None

    def address(self) -> str:
        """host:port for the process group's rendezvous (asked of rank 0)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str) -> None:
        """Join the process group: gloo alone on CPU; on GPU nccl for the gradients, gloo for the CPU rows."""
        import torch.distributed as dist

        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{address}", rank=self.rank, world_size=self.world
        )
        scorer = sharding.shard(self.module) if self.sharded else None
        collective = (ShardedCollective if self.sharded else TorchCollective)(self.rank, self.world)
        named = dict(self.module.named_parameters())  # sharded: the DTensors that replaced them
        autocast = partial(autocast_for, self.module, self.cfg.model.dtype)
        params = [named[n] for n in self.names]
        self.learner = Learner(self.cfg, self.module, params, autocast, collective, scorer)

    def load(self, weights: dict[str, Tensor], optimizer: dict, scheduler: dict) -> None:
        """The trainer's policy, optimizer and schedule state (at the start, or from a checkpoint)."""
        if self.sharded:
            sharding.load_weights(self.module, weights)
            sharding.load_optimizer_state(self.learner.optimizer, optimizer)
        else:
            load_named(self.module, weights)
            self.learner.optimizer.load_state_dict(optimizer)
        self.learner.scheduler.load_state_dict(scheduler)

    def update(self, step: int, batch: Batch) -> dict[str, float]:
        """This rank's part of the update; its metrics are the whole update's (the same on every rank)."""
        return self.learner.update(step, batch)

    def sample_stats(self) -> SampleStats | None:
        """The last update's per-sample log-prob gap and rejection (the same on every rank: the reference is
        merged before them), for the completions table."""
        return self.learner.sample_stats

    def weights_and_schedule(self) -> tuple[dict[str, Tensor], dict] | None:
        """The trained weights and the lr schedule's state (from rank 0; sharded, every rank gathers)."""
        weights = (sharding.full_weights if self.sharded else named_state)(self.module, self.names)
        return (weights, self.learner.scheduler.state_dict()) if self.rank == 0 else None

    def parameter_bytes(self) -> int:
        """Bytes of trainable parameters this rank holds: a whole copy, or under FSDP its shard of each."""
        params = [p for group in self.learner.optimizer.param_groups for p in group["params"]]
        local = [p.to_local() if self.sharded else p for p in params]
        return sum(t.numel() * t.element_size() for t in local)

    def peak_rss(self) -> int:
        """This rank's process's peak resident memory (the run's summary adds it up)."""
        return peak_rss_bytes()

    def optimizer_state(self) -> dict:
        """The optimizer's state in the one-learner format (from rank 0; sharded, every rank gathers)."""
        if self.sharded:
            return sharding.optimizer_state(self.learner.optimizer)
        return self.learner.optimizer.state_dict()


class LearnerGroup:
    """`distributed.learners` `LearnerRank`s behind the local learner's interface; see the module docstring.

    The trainer's own `Learner` (over its policy, never stepped) holds the optimizer and schedule that
    checkpoints save and a resume loads: what it holds at the first update goes to every rank."""

    def __init__(
        self,
        cfg: TrainConfig,
        module: torch.nn.Module,
        params: list[torch.nn.Parameter],
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ):
        import ray

        if params[0].device.type == "cuda" and not cfg.distributed.gpus_per_learner:
            raise ConfigError(
                "the policy is on a GPU (model.device) but distributed.gpus_per_learner=0 puts the learner ranks "
                "on CPUs, where its copy cannot be loaded: set distributed.gpus_per_learner (e.g. 1) or "
                "model.device=cpu"
            )
        self.local = Learner(cfg, module, params, autocast)
        self.ray, self.cfg, self.module = ray, cfg.distributed, module
        ids = {id(p) for p in params}
        self.names = [n for n, p in module.named_parameters() if id(p) in ids]
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            init_ray(ray, cfg.distributed)
        self.ranks: list[Any] = []
        self.placement = None
        self.synced = False  # the ranks hold the trainer's weights and optimizer (sent at the first update)
        self.sample_stats: SampleStats | None = None  # rank 0's, after each update (the completions table)
        self.optimizer_current = True  # the local optimizer holds rank 0's state
        try:
            self._start(cfg)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: TrainConfig) -> None:
        """The placement group (all ranks or none, within start_timeout_s), the ranks, their process group."""
        ray, c = self.ray, self.cfg
        placement.check_schedulable(
            ray, c.learners, c.cpus_per_learner, c.gpus_per_learner, "learners", "distributed.learners"
        )
        self.placement = placement.gang(c.learners, c.cpus_per_learner, c.gpus_per_learner)
        if not placement.placed(ray, self.placement, c.start_timeout_s):
            raise ClusterError(
                f"the {c.learners} learners did not start within {c.start_timeout_s:g} s: each asks for "
                f"{c.cpus_per_learner:g} CPUs and {c.gpus_per_learner:g} GPUs, all at once; free in the Ray "
                f"cluster: {placement.free_resources(ray)} (lower distributed.learners or the per-learner resources)"
            )
        actor = ray.remote(num_cpus=c.cpus_per_learner, num_gpus=c.gpus_per_learner)(LearnerRank)
        module_ref = ray.put(self.module)
        for rank in range(c.learners):
            where = placement.in_bundle(self.placement, rank)
            self.ranks.append(
                actor.options(scheduling_strategy=where).remote(cfg, module_ref, self.names, rank, c.learners)
            )
        address = self._gather([self.ranks[0].address.remote()])[0]
        self._gather([r.join.remote(address) for r in self.ranks])

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer in rank 0's state (fetched when read after an update: checkpoints read it)."""
        if not self.optimizer_current:
            state = self._from_rank0("optimizer_state")
            self.local.optimizer.load_state_dict(state)
            self.optimizer_current = True
        return self.local.optimizer

    @property
    def scheduler(self) -> Any:
        """The lr schedule, at rank 0's position after each update."""
        return self.local.scheduler

    def optimizer_steps(self, batch_size: int) -> int:
        return self.local.optimizer_steps(batch_size)

    def single_update(self, batch_size: int) -> bool:
        return self.local.single_update(batch_size)

    def update(self, step: int, batch: Batch) -> dict[str, float]:
        """Every rank's share of the update; rank 0's weights then go into the trainer's policy."""
        if not self.synced:
            state = (
                named_state(self.module, self.names),
                self.optimizer.state_dict(),
                self.scheduler.state_dict(),
            )
            refs = [self.ray.put(x) for x in state]
            self._gather([r.load.remote(*refs) for r in self.ranks])
            self.synced = True
        batch_ref = self.ray.put(batch)
        metrics = self._gather([r.update.remote(step, batch_ref) for r in self.ranks])[0]
        self.sample_stats = self._gather([self.ranks[0].sample_stats.remote()])[0]
        weights, schedule = self._from_rank0("weights_and_schedule")
        load_named(self.module, weights)
        bump_weights_version(self.module)  # engines over the trainer's policy repack
        self.local.scheduler.load_state_dict(schedule)
        self.optimizer_current = False
        return metrics

    def _from_rank0(self, method: str) -> Any:
        """Rank 0's answer to `method`; sharded ranks gather the whole state together, so all are asked."""
        ranks = self.ranks if self.cfg.fsdp else self.ranks[:1]
        return self._gather([getattr(r, method).remote() for r in ranks])[0]

    def _gather(self, refs: list[Any]) -> list[Any]:
        """The ranks' results in order; the first rank to fail stops the group (`_stop`)."""
        ray, pending = self.ray, list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                self._stop(e, pending)
        return ray.get(refs)

    def _stop(self, error: Exception, pending: list[Any]) -> NoReturn:
        """Stop the group after a rank failed (the others would wait for it in a collective) and raise its error
        as itself (WeightsDiverged stays one), or name a rank that died. The others' results are read first, so
        that ranks that failed alike are not logged as unhandled errors."""
        for ref in pending:
            with contextlib.suppress(Exception):
                self.ray.get(ref, timeout=1)
        self.close()
        if isinstance(error, self.ray.exceptions.RayActorError):
            raise RuntimeError(
                f"a learner rank died ({error}); the run stops: resume it from its last checkpoint (--resume)"
            ) from None
        raise error.cause if isinstance(error.cause, Exception) else error from None

    def process_peaks(self) -> dict[str, int]:
        """Each rank's process's peak resident memory."""
        return actor_peaks(self.ray, self.ranks, "learner rank")

    def close(self) -> None:
        """Stop the ranks, free their placement group, and the local Ray if the group started it."""
        for rank in self.ranks:
            self.ray.kill(rank)
        self.ranks = []
        if self.placement is not None:
            placement.remove(self.placement)
            self.placement = None
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False


def named_state(module: torch.nn.Module, names: list[str]) -> dict[str, Tensor]:
    """The named parameters' tensors, detached on the CPU (what travels between the trainer and the ranks)."""
    named = dict(module.named_parameters())
    return {n: named[n].detach().cpu() for n in names}
