"""The `ray` rollout backend: rollout workers as Ray actors (`distributed.rollout_workers`).

Each worker holds its own copy of the model and a local backend (engine + scheduler). The trainer is the single
controller: `run` splits the requests into one contiguous share per worker (a group's samples stay together,
so its prompt is prefilled once), gathers each share's plain `Segment`s as it finishes (`ray.wait`), and hands
them to the layer. Weights travel after every optimizer phase with their version (the trainable tensors only:
with LoRA, the adapter), through the object store or a torch.distributed broadcast (distributed/weight_sync.py,
`distributed.weight_sync`); a worker asked to run at a version it does not hold refuses. A
worker that dies mid-run (its process killed) is replaced, sent the current weights, and its share runs again
on it: its segments had not been handed over, so no sample is lost or duplicated, and none is stale.

Rewards are scored on the workers too (`reward_worker`): each finished group's texts go to a worker (round robin)
that holds a copy of the task, so its reward functions run there and must be importable there; a worker lost
before it answers is replaced and its groups are scored again (rewards are a function of the texts).

Ray is imported when the backend is built, never when sparserl is imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from sparserl.distributed.cluster import init_ray
from sparserl.distributed.placement import check_schedulable, free_resources
from sparserl.distributed.weight_sync import (
    WEIGHT_SYNCS,
    broadcast,
    client_store,
    open_group,
    resolve_weight_sync,
)
from sparserl.distributed.weights import load_named
from sparserl.engine.decoding import Request, Sampling
from sparserl.engine.run_settings import engine_settings
from sparserl.engine.weights import bump_weights_version
from sparserl.errors import ClusterError, UserError
from sparserl.process_memory import actor_peaks, peak_rss_bytes
from sparserl.rollout.backend import (
    LocalBackend,
    RolloutBackend,
    Segment,
    merge_run_metrics,
    register_backend,
)
from sparserl.rollout.records import Recording
from sparserl.rollout.rewards import Rewards

Group = tuple[Any, list[str], list[Any], "list[list[int]] | None"]  # key, texts, examples, completion ids


class RolloutWorker:
    """One Ray actor's state: a model copy, its engine and a local backend; `run` returns plain values."""

    def __init__(
        self, model: Any, tokenizer: Any, engine_args: dict[str, Any], rollout_cfg: Any, threads: int
    ):
        from sparserl.engine import RolloutEngine

        torch.set_num_threads(threads)
        self.backend = LocalBackend(RolloutEngine(model, tokenizer, **engine_args), rollout_cfg)
        # its runs never grow (the driver plans a tree's children for a later round): it keeps the states of
        # the paths it finished, for children sent to it then (engine/forks.py)
        self.backend.grows_runs = False

    def ready(self) -> int:
        return os.getpid()

    def peak_rss(self) -> int:
        """This worker's process's peak resident memory (the run's summary adds it up)."""
        return peak_rss_bytes()

    def push(self, version: int, state: dict[str, torch.Tensor]) -> int:
        """Load the trainable tensors of policy `version` (in place) and hold that version."""
        load_named(self.backend.engine.model, state)
        self.backend.push_weights(version)
        return version

    def join_weight_group(
        self, host: str, port: int, backend: str, timeout_s: float, rank: int, world: int
    ) -> bool:
        """Join the trainer's weight group (`distributed.weight_sync=broadcast`) as `rank`."""
        self.weight_group = open_group(client_store(host, port, timeout_s), rank, world, backend, timeout_s)
        self.weight_backend = backend
        return True

    def receive_weights(self, version: int, sent: list[tuple[str, torch.dtype]]) -> int:
        """Take policy `version`'s tensors (`sent`: name and travelling dtype, in order) from the trainer's
        broadcast, into the model's parameters in place."""
        model = self.backend.engine.model
        params = dict(model.named_parameters())
        tensors, dtypes = [params[name] for name, _ in sent], [dtype for _, dtype in sent]
        broadcast(self.weight_group, tensors, self.weight_backend, rank=-1, dtypes=dtypes)
        bump_weights_version(model)  # written under autograd's version counters: the packed copy must go
        self.backend.push_weights(version)
        return version

    def run(self, requests: list[Request], sampling: Sampling, version: int, seed: int) -> tuple[list, dict]:
        self.backend.check_version(version)
        segments: list[Segment] = []
        metrics = self.backend.run(requests, sampling, version, seed, segments.append)
        return segments, metrics

    def score(self, prompts: list[list[int]], completions: list[list[int]], temperature: float) -> list:
        return self.backend.score(prompts, completions, temperature)

    def redraw(self, *args: Any) -> list:
        return self.backend.redraw(*args)

    def set_task(self, task: Any) -> bool:
        """Hold the run's TaskView (unpickling it imports the task's reward functions here); the counts its
        copy brought along are the driver's, so they are dropped."""
        self.task = task
        task.start_rewards()
        task.drain_counters()
        return True

    def rewards(
        self,
        texts: list[str],
        examples: list[Any],
        completion_ids: list[list[int]] | None = None,
        step: int = 0,
    ) -> tuple[list[float], dict[str, float]]:
        """One group's rewards (with what the reward functions logged: Rewards) and the reward counters
        (calls, errors, timeouts) they added; `step` is the driver's updates done (trainer_state)."""
        self.task.step = step
        return self.task.scores(texts, examples, completion_ids), self.task.drain_counters()


class WorkerRewards:
    """The layer's reward worker when the rollout workers score. Asynchronous (`rollout.async_rewards`, the
    default): `submit` sends each group to the next worker (round robin) and returns at once. Otherwise groups
    wait for `wait`, and each worker then scores its share of whole groups in one call, so a reward function
    sees a batch of several groups (TRL's `reward_funcs` convention). `wait` gathers every group's rewards and
    adds the workers' counters to the driver's TaskView."""

    def __init__(self, backend: RayBackend, task: Any, asynchronous: bool = True):
        self.backend, self.task, self.asynchronous = backend, task, asynchronous
        self.pending: list[tuple[Any, list[Group]]] = []  # (ref, its groups)
        self.queued: list[Group] = []  # until `wait`
        self.turn = 0

    def submit(
        self,
        key: Any,
        score: Callable,
        texts: list[str],
        examples: list[Any],
        completion_ids: list[list[int]] | None = None,
    ) -> None:
        group = (key, texts, examples, completion_ids)
        if not self.asynchronous:
            self.queued.append(group)
            return
        self.turn = (self.turn + 1) % len(self.backend.workers)
        self.pending.append((self._send(self.turn, [group]), [group]))

    def _send(self, i: int, groups: list[Group]) -> Any:
        texts = [text for _, group_texts, _, _ in groups for text in group_texts]
        examples = [example for _, _, group_examples, _ in groups for example in group_examples]
        ids = None if any(g[3] is None for g in groups) else [t for g in groups for t in g[3]]
        return self.backend.workers[i].rewards.remote(texts, examples, ids, self.task.step)

    def wait(self) -> dict[Any, Rewards]:
        size = max(1, -(-len(self.queued) // len(self.backend.workers)))
        for i, at in enumerate(range(0, len(self.queued), size)):  # one share of whole groups per worker
            self.pending.append((self._send(i, self.queued[at : at + size]), self.queued[at : at + size]))
        out, ray = {}, self.backend.ray
        for ref, groups in self.pending:
            try:
                scores, counters = ray.get(ref)
            except ray.exceptions.RayActorError:  # lost before it answered: a new worker scores them again
                self.backend.replace_dead()
                scores, counters = ray.get(self._send(0, groups))
            parts = Rewards.of(scores).split([len(g[1]) for g in groups])
            out.update({g[0]: part for g, part in zip(groups, parts, strict=True)})
            for name, value in counters.items():
                self.task.counters[name] = self.task.counters.get(name, 0.0) + value
        self.pending, self.queued = [], []
        return out

    def close(self) -> None:
        self.pending, self.queued = [], []


@register_backend("ray")
class RayBackend(RolloutBackend):
    """`distributed.rollout_workers` Ray actors, each a `RolloutWorker`; see the module docstring."""

    scores = True  # whole shares on the workers: no recording, no early stop
    copies_weights = True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        engine_args: dict[str, Any],
        rollout_cfg: Any,
        distributed: Any,
        recording: Recording | None = None,
    ):
        """Workers over copies of `model`, each with a `RolloutEngine(model, tokenizer, **engine_args)`."""
        super().__init__(recording)
        if self.recording.any or rollout_cfg.partial.enable:
            raise ValueError(
                "distributed.rollout_workers > 0 runs whole shares on the workers and returns tokens and log-probs "
                "only: it cannot record distributions or held positions (trainer.log_acceptance, distill.enable, "
                "algo.keep_sampling_mask) "
                "or stop a step early (rollout.partial.enable) yet"
            )
        import ray

        self.ray, self.cfg, self.rollout_cfg = ray, distributed, rollout_cfg
        self.tokenizer, self.engine_args = tokenizer, engine_args
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            init_ray(ray, distributed)
        self.restarts, self.workers, self.pids, self.state, self.task_ref = 0, [], [], None, None
        sync = resolve_weight_sync(distributed.weight_sync, distributed.gpus_per_worker)
        self.sync = WEIGHT_SYNCS.lookup(sync)(ray, distributed.gpus_per_worker, distributed.start_timeout_s)
        try:
            check_schedulable(ray, distributed.rollout_workers, distributed.cpus_per_worker,
                              distributed.gpus_per_worker, "rollout workers", "distributed.rollout_workers")  # fmt: skip
            self.model_ref = ray.put(model)
            self.workers = [self._start_worker() for _ in range(distributed.rollout_workers)]
            self.pids = self.wait_ready(self.workers)  # each worker's process (the fault tests kill them)
        except BaseException:
            self.close()  # no worker left holding resources, no local Ray left running
            raise

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        model: torch.nn.Module,
        tokenizer: Any,
        recording: Recording | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> RayBackend:
        """The workers' engines get the run's engine settings; what they say stays on the workers."""
        return cls(model, tokenizer, engine_settings(cfg, model)[0], cfg.rollout, cfg.distributed, recording)

    def _start_worker(self) -> Any:
        c = self.cfg
        actor = self.ray.remote(num_cpus=c.cpus_per_worker, num_gpus=c.gpus_per_worker)(RolloutWorker)
        threads = max(1, int(c.cpus_per_worker))
        return actor.remote(self.model_ref, self.tokenizer, self.engine_args, self.rollout_cfg, threads)

    def wait_ready(self, workers: list[Any]) -> list[int]:
        """Every worker started within `start_timeout_s` (their process ids), or an error naming what was asked
        and what is free."""
        ray, c = self.ray, self.cfg
        pending = [w.ready.remote() for w in workers]
        done, waiting = ray.wait(pending, num_returns=len(pending), timeout=c.start_timeout_s)
        if waiting:
            raise ClusterError(
                f"{len(waiting)} of {len(pending)} rollout workers did not start within {c.start_timeout_s:g} s: "
                f"each asks for {c.cpus_per_worker:g} CPUs and {c.gpus_per_worker:g} GPUs; free in the Ray "
                f"cluster: {free_resources(ray)} (lower distributed.rollout_workers or the per-worker "
                "resources)"
            )
        return ray.get(pending)

    def push_weights(self, version: int, state: dict[str, torch.Tensor] | None = None) -> None:
        """`state`, the trainable tensors (the adapter with LoRA), to every worker (`distributed.weight_sync`).
        Workers that died since their last call are replaced first; one that dies during the push fails it, and
        the push is made again after its replacement."""
        if state is None:
            raise ValueError(
                f"rollout backend {self.name!r}: its workers hold copies of the weights, so push_weights({version}, "
                "state) needs the tensors that changed (sparserl.distributed.weights.trainable_state)"
            )
        self.replace_dead()
        self.version, self.state = version, state
        try:
            self.sync.push(self.workers, version, self.state)
        except (self.ray.exceptions.RayError, RuntimeError):
            self.sync.reset()
            self.replace_dead()
            self.sync.push(self.workers, version, self.state)

    def run(
        self,
        requests: list[Request],
        sampling: Sampling,
        version: int,
        seed: int,
        on_segment: Callable[[Segment], list[Request] | None],
        stop: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        shares = split([r.prompt for r in requests], len(self.workers))
        todo = {self._submit(i, requests, shares[i], sampling, version, seed): i for i in range(len(shares))}
        metrics: list[dict] = []
        while todo:
            (ref,), _ = self.ray.wait(list(todo), num_returns=1)
            i = todo.pop(ref)
            try:
                segments, m = self.ray.get(ref)
            except self.ray.exceptions.RayActorError:  # the worker died: replace it, run its share again
                self._replace(i)
                todo[self._submit(i, requests, shares[i], sampling, version, seed)] = i
                continue
            start = shares[i].start
            for seg in segments:
                seg.index += start
                on_segment(seg)
            metrics.append(m)
        return {**merge_run_metrics(metrics, side_by_side=True), "worker_restarts": float(self.restarts)}

    def _submit(
        self, i: int, requests: list[Request], share: range, sampling: Sampling, version: int, seed: int
    ):
        return self.workers[i].run.remote([requests[j] for j in share], sampling, version, seed)

    def _replace(self, i: int) -> None:
        self.workers[i] = self._start_worker()
        (self.pids[i],) = self.wait_ready([self.workers[i]])
        if self.state is not None:  # a new worker holds the weights copied at start: send the last push
            self.sync.catch_up(self.workers, i, self.version, self.state)
        if self.task_ref is not None:
            self._send_task(self.workers[i])
        self.restarts += 1

    def replace_dead(self) -> None:
        """Replace every worker whose process is gone (found out by a call that failed)."""
        for i, worker in enumerate(self.workers):
            try:
                self.ray.get(worker.ready.remote())
            except self.ray.exceptions.RayActorError:
                self._replace(i)

    def reward_worker(self, task: Any, asynchronous: bool) -> WorkerRewards:
        """Rewards scored on the workers: each is sent the task once (and again when replaced)."""
        self.task_ref = self.ray.put(task)
        for worker in self.workers:
            self._send_task(worker)
        return WorkerRewards(self, task, asynchronous)

    def _send_task(self, worker: Any) -> None:
        try:
            self.ray.get(worker.set_task.remote(self.task_ref))
        except self.ray.exceptions.RayActorError:
            raise
        except self.ray.exceptions.RayError as e:
            cause = str(e).strip().splitlines()[-1]
            raise UserError(
                f"the task's reward functions could not be loaded on a rollout worker ({cause}): with "
                "distributed.rollout_workers the workers score the rewards, so every module a reward function "
                "comes from must be importable there (installed in the workers' environment, or on their "
                "PYTHONPATH, e.g. through the cluster's runtime_env)"
            ) from None

    def score(self, prompts: list[list[int]], completions: list[list[int]], temperature: float) -> list:
        return self._on_first_worker("score", prompts, completions, temperature)

    def redraw(
        self,
        prompts: list[list[int]],
        drafts: list[list[int]],
        streams: list[tuple[int, int]],
        temperature: float,
        batched: bool = True,
    ) -> list[tuple[int, list[float]]]:
        return self._on_first_worker("redraw", prompts, drafts, streams, temperature, batched)

    def _on_first_worker(self, method: str, *args: Any) -> Any:
        """A worker method's answer from the first worker (replaced, and asked again, if it died)."""
        try:
            return self.ray.get(getattr(self.workers[0], method).remote(*args))
        except self.ray.exceptions.RayActorError:
            self._replace(0)
            return self.ray.get(getattr(self.workers[0], method).remote(*args))

    def process_peaks(self) -> dict[str, int]:
        return actor_peaks(self.ray, self.workers, "rollout worker")

    def close(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False


def split(prompts: list[list[int]], parts: int) -> list[range]:
    """Requests (by their prompts) in up to `parts` contiguous shares of near-equal size, cut only where the
    prompt changes, so that a group's samples stay on one worker (its prompt prefilled once)."""
    cuts = [i for i in range(1, len(prompts)) if prompts[i] != prompts[i - 1]]
    bounds = [0]
    for j in range(1, parts):
        target = round(j * len(prompts) / parts)
        best = min((c for c in cuts if c > bounds[-1]), key=lambda c: abs(c - target), default=None)
        if best is not None and best < len(prompts):
            bounds.append(best)
    bounds.append(len(prompts))
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
