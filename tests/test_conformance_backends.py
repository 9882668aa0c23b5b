"""Conformance of every registered rollout backend (`BACKENDS`): each is built as a run builds it (the Trainer's
`make_backend`), then checked against the seam's contract: a stale weights version refused, every request
answered by exactly one segment with finite sampler log-probs, and each capability the class declares honoured
(partial stop, scoring, recording, deterministic streams, runs that grow). A new backend is tested by
registering it; `NEEDS` says what one takes beyond `rollout.backend=<name>` on one machine."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import count

import pytest
import torch

from sparserl.engine.decoding import Request, Sampling
from sparserl.rollout import BACKENDS, RolloutBackend, Segment, StaleWeights
from sparserl.trainer import Trainer
from tests.registered import Needs
from tests.test_trainer import make_trainer, tiny_cfg

NEEDS = {
    "ray": Needs(("distributed.rollout_workers=1",), "a local Ray and a worker process start (~20 s)", "ray"),
}

# kv.budget=48 over the tiny task's 41-token prompts: SHORT new tokens never evict (the sampler is the dense
# model there, which scoring is compared with), LONG ones do (the other checks run on an evicting cache).
SETTINGS = ("kv.budget=48", "kv.interval=4")
SHORT, LONG = 6, 16
SEED = 11
# sampler vs teacher-forced log-probs on an unevicted cache: measured 6e-6 in this process; a worker process's
# kernels round 1.5e-5 apart (tests/test_ray_backend.py)
SCORE_TOL = 1e-4
FINISHED = ("stop", "eos", "length")
# what a run asks its backend to record: alpha's distributions (top-2 and full), DistillSparse's held positions
RECORDING = (
    "trainer.log_acceptance=true",
    "trainer.acceptance_top_k=2",
    "trainer.acceptance_exact=true",
    "distill.enable=true",
    "distill.lora_r=4",
)


def backends() -> list:
    """One parameter per registered backend, marked slow where building it is."""
    return [NEEDS.get(name, Needs()).param(name, id=name) for name in sorted(BACKENDS)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(name, settings) -> the Trainer that built the backend: one build each for the module, closed at its end
    (last first)."""
    trainers: dict[tuple[str, ...], Trainer] = {}

    def build(name: str, *extra: str) -> Trainer:
        key = (name, *extra)
        if key not in trainers:
            needs = NEEDS.get(name, Needs())
            needs.importable()
            run = tmp_path_factory.mktemp(name)
            trainers[key] = make_trainer(
                tiny_cfg(run, f"rollout.backend={name}", *SETTINGS, *needs.settings, *extra)
            )
        return trainers[key]

    yield build
    for trainer in reversed(list(trainers.values())):
        trainer.close()


@pytest.fixture
def trainer(request, built) -> Trainer:
    """The parametrised backend's Trainer, its backend at version 0."""
    trainer = built(request.param)
    trainer.push_weights(0)  # as the run hands them (the trainable tensors to a copying one)
    return trainer


def parametrise(test: Callable) -> Callable:
    return pytest.mark.parametrize("trainer", backends(), indirect=True)(test)


def requests(trainer: Trainer, new_tokens: int, rows: int = 2, n: int = 3) -> list[Request]:
    """n samples of each of the first `rows` task rows (a group's samples side by side, as the layer asks)."""
    view = trainer.train_view
    return [
        Request(view.prompt_ids(r), r * n + j, SEED, new_tokens)
        for r in trainer.train_rows[:rows]
        for j in range(n)
    ]


def run(
    backend: RolloutBackend, reqs: list[Request], stop: Callable[[], bool] | None = None
) -> tuple[list[Segment], dict[str, float]]:
    """The segments of one run at the version the backend holds, by request, each checked for its shape: one
    per request (none lost or duplicated), the version, and finite log-probs, one per new token."""
    segments: list[Segment] = []
    metrics = backend.run(reqs, Sampling(), backend.version, SEED, segments.append, stop)
    assert sorted(s.index for s in segments) == list(range(len(reqs))), "a request lost or answered twice"
    segments.sort(key=lambda s: s.index)
    for seg, req in zip(segments, reqs, strict=True):
        assert seg.version == backend.version
        assert len(seg.logps) == len(seg.tokens) <= req.max_new_tokens - len(req.prefix)
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in seg.logps), seg.logps
        assert seg.finish is None or seg.finish in FINISHED
    return segments, metrics


def evicted(metrics: dict[str, float]) -> bool:
    """Whether the run's cache evicted (True for a backend that does not count it)."""
    return metrics.get("compression_events", 1) > 0


def cls_of(trainer: Trainer) -> type[RolloutBackend]:
    return type(trainer.rollouts.backend)


@parametrise
def test_a_stale_weights_version_is_refused(trainer):
    backend = trainer.rollouts.backend
    backend.check_version(0)
    with pytest.raises(StaleWeights, match="version 0 but was asked to sample at version 1"):
        backend.check_version(1)
    trainer.push_weights(1)
    backend.check_version(1)
    with pytest.raises(StaleWeights, match="version 1 but was asked to sample at version 0"):
        backend.check_version(0)
    segments, _ = run(backend, requests(trainer, SHORT, rows=1, n=2))
    assert {s.version for s in segments} == {1}


@parametrise
def test_every_request_finishes_once_with_finite_log_probs(trainer):
    """Two groups interleaved with a resumed sample (its prefix not returned again): each request answered once,
    finished, with its own stream's tokens."""
    backend = trainer.rollouts.backend
    reqs = requests(trainer, LONG)
    reqs[1].prefix = reqs[1].prompt[-3:]  # a sample resumed with three tokens drawn already
    reqs = reqs[::2] + reqs[1::2]
    segments, metrics = run(backend, reqs)
    assert all(s.finish in FINISHED for s in segments)
    assert all(s.finish != "length" or len(s.tokens) == r.max_new_tokens - len(r.prefix)
               for s, r in zip(segments, reqs, strict=True))  # fmt: skip
    assert evicted(metrics)
    assert metrics.get("generated_tokens", sum(len(s.tokens) for s in segments)) == sum(
        len(s.tokens) for s in segments
    )


@parametrise
def test_a_stopped_run_returns_its_unfinished_samples_and_they_resume(trainer):
    """A backend declaring `partial_stop`: stopped after two decode steps, every sample comes back once,
    unfinished (finish None) with its tokens so far; resumed from them (deterministic streams), each ends as
    the sample run straight through."""
    backend = trainer.rollouts.backend
    if not backend.partial_stop:
        pytest.skip(f"{backend.name!r} does not declare partial_stop")
    reqs = requests(trainer, SHORT)
    calls = count()
    stopped, _ = run(backend, reqs, stop=lambda: next(calls) >= 1)
    assert all(s.finish is None and 0 < len(s.tokens) < SHORT for s in stopped)
    if not backend.deterministic_streams:
        return
    straight, _ = run(backend, reqs)
    resumed, _ = run(backend, [Request(r.prompt, r.key, r.seed, r.max_new_tokens, s.tokens)
                               for r, s in zip(reqs, stopped, strict=True)])  # fmt: skip
    whole = [s.tokens + r.tokens for s, r in zip(stopped, resumed, strict=True)]
    assert whole == [s.tokens for s in straight]
    assert [s.finish for s in resumed] == [s.finish for s in straight]


@parametrise
def test_requests_returned_as_samples_finish_join_the_run(trainer):
    """A backend declaring `grows_runs`: the requests `on_segment` returns (one per finished sample: a new
    stream continuing its first two tokens, as a tree's child) are answered once each in the same run, their
    indices continuing the list's, with the tokens they draw in a run of their own."""
    backend = trainer.rollouts.backend
    if not backend.grows_runs:
        pytest.skip(f"{backend.name!r} does not declare grows_runs")
    reqs, joined, segments = requests(trainer, SHORT), [], []

    def on_segment(seg: Segment) -> list[Request] | None:
        segments.append(seg)
        if seg.index >= len(reqs):
            return None
        r = reqs[seg.index]
        joined.append(Request(r.prompt, r.key + 1000, r.seed, r.max_new_tokens, seg.tokens[:2]))
        return joined[-1:]

    backend.run(reqs, Sampling(), backend.version, SEED, on_segment)
    assert sorted(s.index for s in segments) == list(range(2 * len(reqs))), "a request lost or answered twice"
    got = {s.index: s.tokens for s in segments}
    alone, _ = run(backend, joined)
    assert [got[len(reqs) + j] for j in range(len(joined))] == [s.tokens for s in alone]


@parametrise
def test_streams_depend_on_seed_and_key_only(trainer):
    """A backend declaring `deterministic_streams`: the same requests twice give the same tokens, and a sample's
    tokens do not depend on its batch mates or its place in the list (an evicting cache included)."""
    backend = trainer.rollouts.backend
    if not backend.deterministic_streams:
        pytest.skip(f"{backend.name!r} does not declare deterministic_streams")
    reqs = requests(trainer, LONG)
    first, metrics = run(backend, reqs)
    again, _ = run(backend, reqs)
    alone, _ = run(backend, reqs[-2:] + reqs[:1])  # the second group's last two, then the first group's first
    assert evicted(metrics)
    assert [s.tokens for s in again] == [s.tokens for s in first]
    assert [s.tokens for s in alone] == [first[i].tokens for i in (-2, -1, 0)]
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(torch.tensor(a.logps), torch.tensor(b.logps), atol=SCORE_TOL, rtol=0)
    assert len({tuple(s.tokens) for s in first}) > 1, "every stream drew the same tokens"


@parametrise
def test_scores_match_the_sampler(trainer):
    """A backend declaring `scores`: teacher-forced log-probs of its own samples, finite, one per token, equal
    to the sampler's where the cache held everything, and a sequence's the same alone or in a batch."""
    backend = trainer.rollouts.backend
    if not backend.scores:
        pytest.skip(f"{backend.name!r} does not declare scores")
    reqs = requests(trainer, SHORT)
    segments, metrics = run(backend, reqs)
    assert not metrics.get("compression_events", 0), "the comparison needs a cache that held every position"
    prompts, completions = [r.prompt for r in reqs], [s.tokens for s in segments]
    scored = backend.score(prompts, completions, trainer.cfg.rollout.temperature)
    assert [len(x) for x in scored] == [len(c) for c in completions]
    assert all(math.isfinite(lp) for x in scored for lp in x)
    pairs = [(a, b) for x, s in zip(scored, segments, strict=True) for a, b in zip(x, s.logps, strict=True)]
    gap = max(abs(a - b) for a, b in pairs)
    assert gap <= SCORE_TOL, f"teacher-forced log-probs {gap:.2e} from the sampler's"
    assert backend.score(prompts[-1:], completions[-1:], trainer.cfg.rollout.temperature) == scored[-1:]
    # redrawn on their own streams, teacher-forced, the samples are drawn again whole (SPEC-RL's coupled test)
    streams = [(r.seed, r.key) for r in reqs]
    redrawn = backend.redraw(prompts, completions, streams, trainer.cfg.rollout.temperature)
    assert [cut for cut, _ in redrawn] == [len(c) for c in completions]
    assert (
        max(abs(a - b) for (_, x), y in zip(redrawn, scored, strict=True) for a, b in zip(x, y, strict=True))
        <= SCORE_TOL
    )


@parametrise
def test_a_recording_is_filled(trainer, built):
    """A backend declaring `records`, built by a run that asks for recordings: every segment carries the
    distributions its tokens were drawn from (top-k and full, the sampled token's log-prob among them) and the
    positions its evicting cache held."""
    name = trainer.rollouts.backend.name
    if not cls_of(trainer).records:
        pytest.skip(f"{name!r} does not declare records")
    backend = built(name, *RECORDING).rollouts.backend
    asked = backend.recording
    assert (asked.top_logprobs, asked.full_logprobs, asked.held) == (2, True, True), "no recording asked for"
    segments, metrics = run(backend, requests(trainer, LONG))
    assert evicted(metrics)
    for seg in segments:
        d, t = seg.distributions, len(seg.tokens)
        assert d.top_ids.shape == d.top_logprobs.shape == (t, 2) and d.full_logprobs.shape[0] == t
        drawn = d.full_logprobs[torch.arange(t), torch.tensor(seg.tokens)]
        torch.testing.assert_close(drawn, torch.tensor(seg.logps), atol=1e-5, rtol=0)
        torch.testing.assert_close(d.top_logprobs[:, 0], d.full_logprobs.max(-1).values)
        assert seg.held is not None and seg.held.fed and len(seg.held.fed) == len(seg.held.held)


def test_the_ray_backend_is_chosen_by_its_name_with_workers_and_refused_without():
    """`rollout.backend=ray` (its registered name) runs with distributed.rollout_workers, and without any worker
    is refused at start-up rather than failing at the first run."""
    from sparserl.config import load_config
    from sparserl.config.errors import ConfigError
    from sparserl.rollout import check_backend
    from sparserl.rollout.backend import backend_class

    with_workers = load_config(None, ["rollout.backend=ray", "distributed.rollout_workers=2"])
    assert backend_class(with_workers).name == "ray"
    with pytest.raises(ConfigError, match="set distributed.rollout_workers >= 1"):
        check_backend(load_config(None, ["rollout.backend=ray"]))
