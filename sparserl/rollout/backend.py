"""Rollout backends: what runs a list of requests and returns plain values. One small class per backend.

`run(requests, sampling, version, seed, on_segment, stop)` decodes the requests with the weights of policy
`version` and calls `on_segment(Segment)` as each sample finishes (and, after `stop()` says so, once for each
sample left unfinished): its new tokens, their sampler log-probs, its finish reason, the version that drew
them and what was asked to be recorded; a backend that `grows_runs` decodes the requests `on_segment` returns
in the same run (a tree's children as their parent finishes). No engine object leaves the backend, so a remote
worker can stand behind the same interface. `push_weights(version, state)` hands the backend the weights of a
new version; a backend asked to run at a version it does not hold refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparserl.config.checks import sampler_records
from sparserl.config.errors import ConfigError
from sparserl.config.rollout import RolloutConfig
from sparserl.engine.decoding import DecodeRun, Request, Sampling
from sparserl.engine.draft_states import redraw_states
from sparserl.engine.forks import Snapshot
from sparserl.engine.held import HeldRecord, HeldRecorder
from sparserl.engine.rollout import RolloutEngine, run_stats
from sparserl.engine.run_settings import engine_settings
from sparserl.engine.sampling import DistributionRecorder, sample_uniforms
from sparserl.engine.scoring import redraw, score
from sparserl.registry import Registry
from sparserl.rollout.records import Recording
from sparserl.rollout.rewards import RewardWorker
from sparserl.rollout.scheduler import Scheduler


@dataclass
class Segment:
    """One sample's share of a backend run: `tokens` drawn in it (a resumed sample's prefix excluded), their
    sampler `logps`, `finish` ('stop', 'eos', 'length'; None when stopped unfinished), the policy `version`
    that drew them, and, when asked for, the `distributions` they were drawn from (alpha) and the positions an
    evicting cache `held` (DistillSparse's replay)."""

    index: int  # position of the sample's request in the run's list
    tokens: list[int]
    logps: list[float]
    finish: str | None
    version: int
    distributions: Any = None
    held: HeldRecord | None = None

    @property
    def completion_ids(self) -> list[int]:
        """The tokens under the name alpha's measurement reads (engine.acceptance.rollout_acceptance)."""
        return self.tokens


class StaleWeights(RuntimeError):
    """A backend was asked to sample with a policy version it does not hold."""


class RolloutBackend:
    """Base class of the registry. Subclasses implement `run`; `push_weights` records the version held and
    `check_version` refuses another (the rollout layer calls it before every run). The class declares what it
    guarantees (`CAPABILITIES`); `check_backend` refuses a config that asks for more."""

    name: ClassVar[str] = ""
    records: ClassVar[bool] = False  # honours `Recording`: distributions and held positions on its segments
    partial_stop: ClassVar[bool] = False  # `stop()` ends a run early, its unfinished samples returned (APRIL)
    scores: ClassVar[bool] = False  # `score` and `redraw`: teacher-forced passes (SPEC-RL's verification)
    deterministic_streams: ClassVar[bool] = True  # a sample's tokens depend on (seed, key, weights) only
    copies_weights: ClassVar[bool] = False  # samples from copies of the weights: push_weights needs `state`
    grows_runs: ClassVar[bool] = False  # requests `on_segment` returns join the running run (tree children)

    def __init__(self, recording: Recording | None = None) -> None:
        self.version = 0
        self.recording = recording or Recording()

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        model: torch.nn.Module,
        tokenizer: Any,
        recording: Recording | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> RolloutBackend:
        """Built from the run's TrainConfig over the policy's `model` and `tokenizer`: whatever it samples with
        (an engine, workers holding copies) it builds itself, with `engine_settings`. `notify` is told what the
        run should hear (a decode step compiling)."""
        raise NotImplementedError(f"rollout backend {cls.name!r} does not say how to build it from a config")

    def push_weights(self, version: int, state: dict[str, torch.Tensor] | None = None) -> None:
        """Hold the weights of policy `version`. `state`: the tensors that changed (the trainable state,
        `sparserl.distributed.weights.trainable_state`), which a backend that `copies_weights` needs; None for
        one that samples from the trained modules themselves."""
        self.version = version

    def check_version(self, version: int) -> None:
        if version != self.version:
            raise StaleWeights(
                f"rollout backend {self.name!r} holds the weights of policy version {self.version} but was asked "
                f"to sample at version {version}: push_weights({version}, ...) first"
            )

    def run(
        self,
        requests: list[Request],
        sampling: Sampling,
        version: int,
        seed: int,
        on_segment: Callable[[Segment], list[Request] | None],
        stop: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        """Decode `requests` (never empty) with the weights of policy `version`, which the caller has checked
        with `check_version`; returns the run's metrics (throughput, KV memory, scheduling). A backend that
        `grows_runs` decodes the requests `on_segment` returns in the same run, their indices continuing the
        list's; others ignore them."""
        raise NotImplementedError

    def score(
        self, prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]]:
        """Teacher-forced log-probs of each completion under the weights held now, dense, one sequence at a
        time so that a sequence's numbers do not depend on its batch mates (SPEC-RL's verification)."""
        raise NotImplementedError(
            f"rollout backend {self.name!r} cannot score completions teacher-forced, which rollout.spec needs"
        )

    def redraw(
        self,
        prompts: list[list[int]],
        drafts: list[list[int]],
        streams: list[tuple[int, int]],
        temperature: float,
        batched: bool = True,
    ) -> list[tuple[int, list[float]]]:
        """Per draft drawn on the stream (seed, key): how many of its leading tokens the weights held now draw
        on that stream too, teacher-forced, and the draft tokens' log-probs, up to that point at least
        (`engine.scoring.redraw`, `engine.draft_states`; `batched` False: one sequence at a time). SPEC-RL's
        coupled verification."""
        raise NotImplementedError(
            f"rollout backend {self.name!r} cannot verify drafts teacher-forced, which rollout.spec needs"
        )

    def reward_worker(self, task: Any, asynchronous: bool) -> RewardWorker:
        """Where the layer scores finished groups (`task`: its TaskView): a thread of this process, overlapping
        decoding when `asynchronous`. Backends with workers of their own score there instead."""
        return RewardWorker(asynchronous)

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> None:
        """Refuse at start-up a setting (a KV memory cap) that cannot run one sequence of this prompt length."""

    def process_peaks(self) -> dict[str, int]:
        """The peak resident memory of each process this backend started, by name (none: it runs here)."""
        return {}

    def close(self) -> None:
        """Release workers or threads."""


BACKENDS: Registry[type[RolloutBackend]] = Registry("rollout.backend")
register_backend = BACKENDS.register  # class decorator: `rollout.backend=name`


@register_backend("local")
class LocalBackend(RolloutBackend):
    """This process's engine under the scheduler (continuous batching under `rollout.kv_memory_cap`). It samples
    from the live modules, so `push_weights` has nothing to copy: the trained weights are read afresh at
    every run."""

    records = partial_stop = scores = grows_runs = True

    def __init__(self, engine, cfg: RolloutConfig, recording: Recording | None = None) -> None:
        super().__init__(recording)
        self.engine = engine
        self.scheduler = Scheduler(engine, cfg.kv_memory_cap_bytes, cfg.batching)
        # the states tree children start from, by (seed, key, position), for the weights of `_forks_version`
        self._forks: dict[tuple[int, int, int], Snapshot] = {}
        self._forks_version: int | None = None
        # SPEC-RL drafts' states at their cuts, under the weights held now: the next run continues from them
        self._drafted: dict[tuple[int, int, int], Snapshot] = {}

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        model: torch.nn.Module,
        tokenizer: Any,
        recording: Recording | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> LocalBackend:
        """Its own engine over the policy's modules themselves, with the run's engine settings."""
        engine = RolloutEngine(model, tokenizer, **engine_settings(cfg, model)[0])
        engine.notify = notify
        return cls(engine, cfg.rollout, recording)

    def check_fits(self, prompt_length: int, max_new_tokens: int) -> None:
        self.scheduler.check_fits(prompt_length, max_new_tokens)

    @contextmanager
    def _teacher_forced(self) -> Iterator[None]:
        """No gradients, and the engine's compute dtype as autocast (the sampler's precision)."""
        dtype = self.engine.decoder.dtype
        device = self.engine.model.get_input_embeddings().weight.device.type
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            yield

    def score(
        self, prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]]:
        with self._teacher_forced():
            return [
                score(self.engine.model, [p], [c], temperature)[0].tolist()
                for p, c in zip(prompts, completions, strict=True)
            ]

    def redraw(
        self,
        prompts: list[list[int]],
        drafts: list[list[int]],
        streams: list[tuple[int, int]],
        temperature: float,
        batched: bool = True,
    ) -> list[tuple[int, list[float]]]:
        uniforms = [
            sample_uniforms(seed, [key], len(d))[0] for (seed, key), d in zip(streams, drafts, strict=True)
        ]
        if self.engine.evictor is None:  # on the sampler itself, keeping each draft's state at its cut
            with self.engine.decoding():
                got = redraw_states(self.engine, prompts, drafts, uniforms, temperature, batched)
            for (seed, key), (_, _, state) in zip(streams, got, strict=True):
                self._drafted[(seed, key, state.position)] = state
            return [(cut, logp.tolist()) for cut, logp, _ in got]
        with self._teacher_forced():
            budget = 8192 if batched else 0
            out = redraw(self.engine.model, prompts, drafts, uniforms, temperature, token_budget=budget)
        return [(cut, logp.tolist()) for cut, logp in out]

    def run(
        self,
        requests: list[Request],
        sampling: Sampling,
        version: int,
        seed: int,
        on_segment: Callable[[Segment], list[Request] | None],
        stop: Callable[[], bool] | None = None,
    ) -> dict[str, float]:
        rec = self.recording
        recorder = DistributionRecorder.maybe(
            len(requests), max(r.max_new_tokens for r in requests), rec.top_logprobs, rec.full_logprobs,
            self.engine.decoder.device, rec.kept_sets,
        )  # fmt: skip
        held = HeldRecorder() if rec.held else None

        def segment(run: DecodeRun, i: int) -> Segment:
            tokens, logps = run.completion(i)
            seg = Segment(i, tokens, logps.tolist(), run.finish[i], version)
            if recorder is not None:
                seg.distributions = recorder.take(i, len(tokens))
            if held is not None:
                seg.held = held.records.get(i)
            return seg

        def finished(run: DecodeRun, i: int) -> list[Request] | None:
            self._keep_forks(run, [i])  # for children that join this run
            return self._with_forks(on_segment(segment(run, i)))

        if version != self._forks_version:  # a state is valid for the weights that made it only
            self._forks, self._forks_version = {}, version
        self._forks, self._drafted = self._forks | self._drafted, {}
        requests = self._with_forks(requests)
        # a state serves the run after the one that made it (a tree's next round, SPEC-RL's continuations):
        # those this run's requests do not take are spent (drafts delivered whole, children run elsewhere)
        taken = {r.fork_of for r in requests if r.fork is not None}
        self._forks = {k: s for k, s in self._forks.items() if k in taken}
        with self.engine.step_hook(held):
            run, unfinished, sched = self.scheduler.run(requests, sampling, finished, stop, recorder, seed)
        if self.grows_runs:  # every finished path's children joined this run: their states are spent
            self._forks = {}
        self._keep_forks(run, unfinished if self.grows_runs else run.snapshots.kept)  # for a later run
        for i in unfinished:  # stopped early (APRIL): what they drew so far, unfinished
            on_segment(segment(run, i))
        return {**run_stats(run), **sched.as_metrics()}

    def _keep_forks(self, run: DecodeRun, ids: Iterable[int]) -> None:
        """The states samples `ids` of `run` kept, where later forks may start from them (tree rollouts)."""
        for i in ids:
            r = run.requests[i]
            self._forks |= {(r.seed, r.key, snap.position): snap for snap in run.snapshots.states(i)}

    def _with_forks(self, requests: list[Request] | None) -> list[Request] | None:
        """`requests`, each given the state it forks from when this backend holds it (else it prefills)."""
        for r in requests or ():
            state = self._forks.get(r.fork_of) if r.fork_of is not None else None
            r.fork = state if state is not None and state.held else None  # released under a KV memory cap
        return requests


CAPABILITIES = {
    "records": "record the sampler's distributions and held positions",
    "partial_stop": "stop a run early and return its unfinished samples",
    "scores": "score completions teacher-forced",
}  # what a backend may declare, as errors say it


def backend_class(cfg: Any) -> type[RolloutBackend]:
    """The run's backend: 'ray' with distributed.rollout_workers > 0 (rollout.backend 'local' or 'ray'), else
    rollout.backend; 'ray' without workers would have none to run on."""
    workers, name = cfg.distributed.rollout_workers, cfg.rollout.backend
    if workers and name not in (LocalBackend.name, "ray"):
        raise ConfigError(
            f"distributed.rollout_workers={workers} runs the 'ray' backend, but rollout.backend={name!r} asks "
            "for another: set one of them"
        )
    if name == "ray" and not workers:
        raise ConfigError(
            "rollout.backend='ray' runs the samples on Ray workers: set distributed.rollout_workers >= 1"
        )
    return BACKENDS.lookup("ray" if workers else name)


def check_backend(cfg: Any) -> None:
    """Refuse settings that need a capability the run's backend does not declare (never its name)."""
    cls = backend_class(cfg)
    asks = {**{key: (True, "records") for key in sampler_records(cfg)},
            "rollout.partial.enable": (cfg.rollout.partial.enable, "partial_stop"),
            "rollout.spec.enable": (cfg.rollout.spec.enable, "scores")}  # fmt: skip
    missing = {key: cap for key, (on, cap) in asks.items() if on and not getattr(cls, cap)}
    if missing:
        cannot = sorted({CAPABILITIES[cap] for cap in missing.values()})
        raise ConfigError(
            f"rollout backend {cls.name!r} cannot run with {', '.join(missing)}: it does not {' or '.join(cannot)}"
        )


def make_backend(
    cfg: Any,
    model: torch.nn.Module,
    tokenizer: Any,
    recording: Recording | None = None,
    notify: Callable[[str], None] | None = None,
) -> RolloutBackend:
    """The run's backend (`backend_class`) over the policy's `model`, built from the config alone."""
    return backend_class(cfg).from_config(cfg, model, tokenizer, recording, notify)


SUMMED_METRICS = {
    "preemptions", "cap_truncated", "admissions", "decode_steps", "generated_tokens", "tokens_per_s",
    "compression_events", "fork_prefills",
}  # fmt: skip


def merge_run_metrics(metrics: list[dict[str, Any]], side_by_side: bool) -> dict[str, float]:
    """Several runs' metrics as one: counts summed, peaks the largest, times the largest for runs side by side
    (workers) and summed for runs one after another (a step's rounds), the rest averaged. Throughput is summed
    side by side, and one after another is the tokens over the runs' summed prefill and decode time."""
    out: dict[str, float] = {}
    for key in {k for m in metrics for k, v in m.items() if isinstance(v, int | float)}:
        values = [float(m[key]) for m in metrics if isinstance(m.get(key), int | float)]
        if key in SUMMED_METRICS or (key.endswith("_s") and not side_by_side):
            out[key] = sum(values)
        elif key.startswith("peak") or key.endswith(("_max", "_s")):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    if "tokens_per_s" in out and not side_by_side:
        wall = out.get("prefill_s", 0.0) + out.get("decode_s", 0.0)
        out["tokens_per_s"] = out.get("generated_tokens", 0.0) / wall if wall > 0 else 0.0
    return out
