"""SPEC-RL's delivered samples against the current policy's own draws (rollout.spec.acceptance).

On a two-step chain of hand-made distributions, chi-square over the 9 sequences: SPEC-RL's ratio test (the
rejected token drawn afresh from p_now) delivers sequences that lean toward p_then, and detectably so at lenience
0 and 1, while the coupled redraw (the draft's uniform numbers inverted under p_now) delivers p_now's. On the tiny
model after real updates: every coupled sample is token for token the sample the current policy draws fresh on
the same stream, and batched verification keeps what one-at-a-time verification keeps."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from sparserl.engine.sampling import draw
from sparserl.rollout.reuse import accepted_length
from tests.test_reuse import make

THEN = torch.tensor(
    [[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1], [0.1, 0.1, 0.8]]
)  # row 0: first token
NOW = torch.tensor([[0.2, 0.3, 0.5], [0.3, 0.4, 0.3], [0.1, 0.2, 0.7], [0.6, 0.2, 0.2]])  # row 1 + y1: second


def chain(p: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    return p[0] if not prefix else p[1 + prefix[0]]


def sequence_probs(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([chain(p, [])[a] * chain(p, [a])[b] for a in range(3) for b in range(3)])


def deliver(acceptance: str, g: torch.Generator, lenience: float = 0.0) -> int:
    """One delivered 2-token sequence (its index a * 3 + b): a draft drawn from THEN on a stream, kept by the
    rule, the rest drawn from NOW (ratio: fresh numbers; coupled: the stream's own)."""
    u = torch.rand(2, generator=g, dtype=torch.float64)
    tokens: list[int] = []
    for t in range(2):
        tokens.append(int(draw(chain(THEN, tokens)[None], u[t : t + 1])))
    if acceptance == "coupled":
        now = [int(draw(chain(NOW, tokens[:t])[None], u[t : t + 1])) for t in range(2)]
        cut = next((t for t in range(2) if now[t] != tokens[t]), 2)
        rest = u[cut:]  # the sample goes on on the draft's stream
    else:
        lp_now = [float(chain(NOW, tokens[:t])[tokens[t]].log()) for t in range(2)]
        lp_then = [float(chain(THEN, tokens[:t])[tokens[t]].log()) for t in range(2)]
        check = torch.rand(2, generator=g, dtype=torch.float64).tolist()
        cut = accepted_length(lp_now, lp_then, check, lenience)
        rest = torch.rand(2 - cut, generator=g, dtype=torch.float64)
    kept = tokens[:cut]
    for v in rest:
        kept.append(int(draw(chain(NOW, kept)[None], v[None])))
    return kept[0] * 3 + kept[1]


def p_value(acceptance: str, lenience: float = 0.0, n: int = 6000) -> float:
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([deliver(acceptance, g, lenience) for _ in range(n)]), minlength=9)
    expected = sequence_probs(NOW).double()
    return float(chisquare(counts.double().numpy(), (expected / expected.sum() * n).numpy()).pvalue)


@pytest.mark.parametrize("lenience", [0.0, 1.0])
def test_the_ratio_test_delivers_sequences_that_lean_toward_the_drafting_policy(lenience):
    assert p_value("ratio", lenience) < 1e-6


def test_the_coupled_redraw_delivers_the_current_policys_sequences():
    assert p_value("coupled") > 1e-3


def test_coupled_samples_are_the_current_policys_draws_on_their_streams(tmp_path):
    """After two updates, the step's samples (drafts cut where the policy draws otherwise, then continued) are
    token for token what the engine draws fresh on each sample's stream with the current weights (dense). The
    continuations start from the verification's states at the cut: their prompt + prefix is not prefilled."""
    trainer = make(tmp_path, "optim.lr=0.05", "trainer.steps=3", "algo.preset=dense", "kv.method=dense")
    trainer.train(until_step=2)
    engine = trainer.rollouts.backend.engine
    prefilled: list[tuple[int, ...]] = []
    inner = engine._prefill
    engine._prefill = lambda inputs, *a: prefilled.extend(map(tuple, inputs)) or inner(inputs, *a)
    got = trainer.rollouts.collect_step(trainer.source, 2, 2, 99)
    samples = [s for g in got.groups for s in g.samples]
    continued = [s for s in samples if 0 < s.reused_prefix < len(s.tokens)]
    assert sum(s.reused_prefix for s in samples) > 0 and continued
    for s in continued:
        assert (*trainer.train_view.prompt_ids(s.prompt_id), *s.tokens[: s.reused_prefix]) not in prefilled
    del engine._prefill
    for s in samples:
        prompt = trainer.train_view.prompt_ids(s.prompt_id)
        fresh = engine.generate([prompt], n=1, max_new_tokens=trainer.cfg.rollout.max_new_tokens, seed=s.seed,
                                sample_keys=[s.key])  # fmt: skip
        assert s.tokens == fresh.samples[0].completion_ids


def test_batched_verification_keeps_what_one_at_a_time_keeps(tmp_path):
    trainer = make(tmp_path, "optim.lr=0.05", "trainer.steps=3")
    trainer.train(until_step=2)
    drafts = [(row, d) for row, ds in trainer.source.inner.cache.items() for d in ds]
    prompts = [trainer.train_view.prompt_ids(row) for row, _ in drafts]
    args = [prompts, [d["tokens"] for _, d in drafts], [tuple(d["stream"]) for _, d in drafts], 1.0]
    batched = trainer.rollouts.backend.redraw(*args, batched=True)
    exact = trainer.rollouts.backend.redraw(*args, batched=False)
    assert [c for c, _ in batched] == [c for c, _ in exact]
    for (_, a), (_, b) in zip(batched, exact, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_the_states_of_drafts_delivered_whole_are_dropped_before_the_run(tmp_path):
    """The local backend keeps each verified draft's state at its cut for the run that continues it; a draft the
    engine redraws whole (the sample's own draw on its stream) has no continuation, so the run holds no state of
    it, while the cut draft's continuation starts from its own, charged to the run and to the dense yardstick."""
    from sparserl.engine.decoding import Request, Sampling

    trainer = make(tmp_path, "algo.preset=dense", "kv.method=dense")
    backend, engine = trainer.rollouts.backend, trainer.rollouts.backend.engine
    prompt, n = trainer.train_view.prompt_ids(0), trainer.cfg.rollout.max_new_tokens
    own = engine.generate([prompt], n=1, max_new_tokens=n, seed=7, sample_keys=[1]).samples[0].completion_ids
    other = [t + 1 for t in own]  # not what the engine draws on stream (7, 2) from its first token
    cuts = backend.redraw([prompt, prompt], [own, other], [(7, 1), (7, 2)], 1.0)
    assert [c for c, _ in cuts] == [len(own), 0]
    held = []
    run = backend.scheduler.run
    backend.scheduler.run = lambda requests, *a: held.append(set(backend._forks)) or run(requests, *a)
    backend.push_weights(0)
    continuation = Request(prompt, key=2, seed=7, max_new_tokens=n, fork_of=(7, 2, 0))
    metrics = backend.run([continuation], Sampling(), 0, 0, lambda seg: None)
    assert held == [{(7, 2, 0)}]
    # the run holds the state it continues from, and so would the dense engine: no saving on a dense run
    assert metrics["peak_kv_bytes"] == metrics["peak_dense_kv_bytes"] and metrics["fork_prefills"] == 0
    trainer.close()
