"""The acceptance rate alpha_t = sum_v min(p_sparse(v), p_dense(v)): the pure estimates and their binning
(hand-computed cases, a hypothesis property, bad input), the sampler's and the scorer's recorded distributions,
and alpha measured on tiny models: about 1 when the sampler is dense, below 1 under a tight eviction budget.

A dense sampler and the dense scorer run different kernels (docs/engine.md: log-probs agree to 3.6e-5 at most),
so alpha of a dense run is 1 up to that round-off: DENSE_TOL.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trainer import make_trainer, rows, tiny_cfg

from sparserl.algo import acceptance_by_bin, acceptance_exact, acceptance_metrics, acceptance_topk
from sparserl.algo.acceptance import TOO_FEW_TOKENS, bootstrap_quantile_interval
from sparserl.config import ConfigError
from sparserl.engine import KVConfig, RolloutEngine, score
from sparserl.engine.acceptance import measure_acceptance, rollout_acceptance
from sparserl.engine.sampling import processed_logprobs
from sparserl.engine.scoring import score_distributions
from sparserl.errors import UserError
from sparserl.models import encode_prompt, tiny_model

DENSE_TOL = 1e-4  # alpha of a dense run: 1 up to the sampler/scorer round-off
DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def log(p: list[float]) -> torch.Tensor:
    return torch.tensor(p).log()


def top(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = logp.topk(k, dim=-1)
    return ids, values


# ---------------------------------------------------------------- the estimates


def test_hand_computed_small_case():
    p, q = log([0.5, 0.3, 0.2]), log([0.2, 0.3, 0.5])
    assert acceptance_exact(p, q).item() == pytest.approx(0.2 + 0.3 + 0.2, abs=1e-6)
    # top-2 sets {0, 1} and {2, 1} share only id 1: min(0.3, 0.3)
    assert acceptance_topk(*top(p, 2), *top(q, 2)).item() == pytest.approx(0.3, abs=1e-6)
    # k differs between the sides: top-1 {0} against top-3 {2, 1, 0}: min(0.5, 0.2)
    assert acceptance_topk(*top(p, 1), *top(q, 3)).item() == pytest.approx(0.2, abs=1e-6)
    # a token cut by top-k/top-p (-inf) adds nothing; disjoint supports give 0
    cut = torch.tensor([0.0, float("-inf"), float("-inf")])
    assert acceptance_exact(cut, q).item() == pytest.approx(0.2, abs=1e-6)
    assert acceptance_exact(cut, torch.tensor([float("-inf"), 0.0, float("-inf")])).item() == 0.0


def test_identical_distributions_give_one():
    logp = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)).mul(3).log_softmax(-1)
    assert torch.allclose(acceptance_exact(logp, logp), torch.ones(7), atol=1e-6)
    # the top-k bound of identical distributions is their top-k mass, and 1 once k covers the vocabulary
    mass = logp.exp().topk(5, dim=-1).values.sum(-1)
    assert torch.allclose(acceptance_topk(*top(logp, 5), *top(logp, 5)), mass, atol=1e-6)
    assert torch.allclose(acceptance_topk(*top(logp, 50), *top(logp, 50)), torch.ones(7), atol=1e-6)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    vocab=st.integers(2, 60),
    k_sparse=st.integers(1, 60),
    k_dense=st.integers(1, 60),
    spread=st.floats(0.1, 8.0),
    close=st.floats(0.0, 1.0),
    cut=st.integers(0, 60),
)
def test_topk_bound_never_exceeds_the_exact_value(seed, vocab, k_sparse, k_dense, spread, close, cut):
    g = torch.Generator().manual_seed(seed)
    dense = (torch.randn(4, vocab, generator=g) * spread).log_softmax(-1)
    # the sparse side: a perturbation of the dense one (close = 1: identical), optionally top-`cut` truncated
    sparse_logits = dense + (1 - close) * spread * torch.randn(4, vocab, generator=g)
    sparse = processed_logprobs(sparse_logits, top_k=min(cut, vocab))
    k_s, k_d = min(k_sparse, vocab), min(k_dense, vocab)
    bound = acceptance_topk(*top(sparse, k_s), *top(dense, k_d))
    exact = acceptance_exact(sparse, dense)
    assert bool((bound <= exact + 1e-6).all())
    assert bool((exact >= 0).all()) and bool((exact <= 1 + 1e-6).all())
    assert torch.allclose(exact, acceptance_exact(dense, sparse), atol=1e-6)  # symmetric
    # exact = 1 - total variation distance
    tv = 0.5 * (sparse.exp() - dense.exp()).abs().sum(-1)
    assert torch.allclose(exact, 1 - tv, atol=1e-5)


def test_estimates_name_mismatched_shapes():
    logp = torch.zeros(3, 5).log_softmax(-1)
    ids, values = top(logp, 2)
    with pytest.raises(ValueError, match="sparse_ids and sparse_logprobs differ in shape"):
        acceptance_topk(ids, values[:, :1], ids, values)
    with pytest.raises(ValueError, match="dense_ids and dense_logprobs differ in shape"):
        acceptance_topk(ids, values, ids[:, :1], values)
    with pytest.raises(ValueError, match="leading dims differ"):
        acceptance_topk(ids, values, ids[:2], values[:2])
    with pytest.raises(ValueError, match="sparse_logprobs and dense_logprobs differ in shape"):
        acceptance_exact(logp, logp[:, :4])


# ---------------------------------------------------------------- binning


def test_binning_hand_checked():
    # position i has alpha i / 100 for i < 100: bins of 50 hold 0.00..0.49 and 0.50..0.99; then 5 tokens in bin 2,
    # nothing in bin 3, one token in bin 4
    positions = torch.cat([torch.arange(100), torch.arange(100, 105), torch.tensor([200])])
    alpha = torch.cat([torch.arange(100) / 100, torch.full((5,), 0.9), torch.tensor([0.1])])
    bins = acceptance_by_bin(alpha, positions, bin_width=50, tau=0.855)
    assert [(b.index, b.start, b.end, b.tokens) for b in bins] == [
        (0, 0, 50, 50), (1, 50, 100, 50), (2, 100, 150, 5), (3, 150, 200, 0), (4, 200, 250, 1),
    ]  # fmt: skip
    # linear interpolation between order statistics: P5 of 50 values sits at rank 0.05 * 49 = 2.45
    assert bins[0].p5 == pytest.approx(0.0245) and bins[0].p1 == pytest.approx(0.0049)
    assert bins[0].mean == pytest.approx(0.245) and bins[0].frac_below_tau == 1.0
    assert bins[1].p5 == pytest.approx(0.5245) and bins[1].p1 == pytest.approx(0.5049)
    assert bins[1].frac_below_tau == pytest.approx(36 / 50)  # 0.50 .. 0.85
    for b in bins[2:]:  # fewer than 20 tokens: no tail statistics
        assert b.note == TOO_FEW_TOKENS and b.p5 is None and b.p1 is None and b.mean is None
    assert bins[0].note == "" and bins[2].to_dict()["note"] == TOO_FEW_TOKENS
    assert acceptance_by_bin(torch.zeros(0), torch.zeros(0, dtype=torch.long), 50, 0.86) == []


def test_binning_agrees_with_numpy_percentiles():
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(1)
    alpha = torch.rand(300, generator=g) ** 0.2
    positions = torch.randint(0, 90, (300,), generator=g)
    for b in acceptance_by_bin(alpha, positions, bin_width=30, tau=0.86):
        chosen = alpha[(positions >= b.start) & (positions < b.end)].double().numpy()
        assert b.p5 == pytest.approx(np.percentile(chosen, 5)) and b.p1 == pytest.approx(
            np.percentile(chosen, 1)
        )
        assert b.frac_below_tau == pytest.approx((chosen < 0.86).mean())


def test_metric_names():
    alpha = torch.linspace(0.5, 1.0, 30)
    bins = {"exact": acceptance_by_bin(alpha, torch.arange(30), 25, 0.86)}
    assert acceptance_metrics(bins) == {
        "alpha/tokens/bin0": 25.0,
        "alpha/exact/p5/bin0": bins["exact"][0].p5,
        "alpha/exact/p1/bin0": bins["exact"][0].p1,
        "alpha/exact/mean/bin0": bins["exact"][0].mean,
        "alpha/exact/frac_below_tau/bin0": bins["exact"][0].frac_below_tau,
        "alpha/tokens/bin1": 5.0,  # too few tokens: only the count
    }


def test_bootstrap_interval_resamples_sequences_not_tokens():
    """Tokens of a sequence share its value here (the extreme of within-sequence correlation): resampling the 40
    sequences gives a wider P5 interval than treating the same 2000 tokens as 2000 sequences, and a sequence
    count of 40 per bin; identical values give a point interval."""
    g = torch.Generator().manual_seed(0)
    per_sequence = torch.rand(40, generator=g)
    values, sequences = per_sequence.repeat_interleave(50), torch.arange(40).repeat_interleave(50)
    low, high = bootstrap_quantile_interval(values, sequences, 0.05, resamples=400)
    tok_low, tok_high = bootstrap_quantile_interval(values, torch.arange(2000), 0.05, resamples=400)
    assert low <= tok_low <= tok_high <= high and high - low > 3 * (tok_high - tok_low)
    assert bootstrap_quantile_interval(torch.full((30,), 0.7), torch.arange(30) % 3, 0.05) == (
        pytest.approx(0.7),
        pytest.approx(0.7),
    )
    (b,) = acceptance_by_bin(values, torch.zeros(2000, dtype=torch.long), 10, 0.86, sequences=sequences,
                             resamples=400)  # fmt: skip
    assert b.sequences == 40 and b.p5_low <= b.p5 <= b.p5_high and (b.p5_low, b.p5_high) == (low, high)
    (plain,) = acceptance_by_bin(values, torch.zeros(2000, dtype=torch.long), 10, 0.86)
    assert plain.sequences is None and plain.p5_low is None  # no sequence ids: no interval


def test_bootstrap_interval_covers_the_true_quantile_of_correlated_tokens():
    """40 draws of 30 sequences x 10 tokens, each token its sequence's level U(0, 1) plus N(0, 0.05) noise (true
    P5 0.045, from 2M tokens): the sequence-level 90% interval covers it in 36 of 40 draws (measured), the
    token-level one, which ignores the correlation, in 21 (measured); the bounds 32 and 28 fail either kind of
    mistake. (Independent U(0, 1) tokens, 300 a draw: 33 of 40, the percentile bootstrap's usual slight
    under-coverage at a tail quantile.)"""
    g = torch.Generator().manual_seed(4)
    population = torch.rand(200_000, generator=g)[:, None] + 0.05 * torch.randn(200_000, 10, generator=g)
    true = torch.quantile(population.flatten()[:1_000_000].double(), 0.05).item()
    by_sequence = by_token = 0
    for trial in range(40):
        level = torch.rand(30, generator=g)
        values = (level[:, None] + 0.05 * torch.randn(30, 10, generator=g)).flatten()
        sequences = torch.arange(30).repeat_interleave(10)
        low, high = bootstrap_quantile_interval(values, sequences, 0.05, resamples=300, seed=trial)
        by_sequence += low <= true <= high
        low, high = bootstrap_quantile_interval(values, torch.arange(300), 0.05, resamples=300, seed=trial)
        by_token += low <= true <= high
    assert by_sequence >= 32 and by_token <= 28


@pytest.mark.parametrize("tau", [0.0, -0.1, 1.5, math.nan, True, "0.9"])
def test_tau_outside_zero_one_is_named(tau):
    with pytest.raises(UserError, match=r"tau=.* must be in \(0, 1\]"):
        acceptance_by_bin(torch.ones(3), torch.arange(3), 10, tau)


def test_binning_bad_input_is_named():
    with pytest.raises(UserError, match="bin_width=0"):
        acceptance_by_bin(torch.ones(3), torch.arange(3), 0, 0.86)
    with pytest.raises(ValueError, match="alpha and positions differ in shape"):
        acceptance_by_bin(torch.ones(3), torch.arange(4), 10, 0.86)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        acceptance_by_bin(torch.ones(2), torch.tensor([-1, 0]), 10, 0.86)


# ---------------------------------------------------------------- the engine's and the scorer's distributions


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


def prompts_of(tok) -> list[list[int]]:
    return [encode_prompt(tok, [{"role": "user", "content": "Count: " + "ab" * k}]) for k in (1, 6)]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 5)])
def test_sampler_records_the_distribution_it_sampled_from(tiny, temperature, top_p, top_k):
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    kw = dict(n=4, max_new_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=3)
    engine.eos_ids = {engine.generate(prompts_of(tok), **kw)[0].completion_ids[2]}  # rows leave mid-batch
    plain = engine.generate(prompts_of(tok), **kw)
    out = engine.generate(prompts_of(tok), **kw, top_logprobs=8, full_logprobs=True)
    assert len({len(s.completion_ids) for s in out}) > 1, "want ragged lengths"
    assert all(s.distributions is None for s in plain)  # nothing recorded unless asked
    for a, s in zip(plain, out, strict=True):
        assert a.completion_ids == s.completion_ids and torch.equal(a.logprobs, s.logprobs)  # same draws
        d, t = s.distributions, len(s.completion_ids)
        assert d.top_ids.shape == (t, 8) and d.full_logprobs.shape == (t, len(tok))
        # row t is the distribution token t was drawn from: the recorded log-prob is its entry
        drawn = d.full_logprobs.gather(-1, torch.tensor(s.completion_ids)[:, None]).squeeze(-1)
        assert torch.equal(drawn, s.logprobs)
        assert torch.equal(d.top_logprobs, d.full_logprobs.topk(8, dim=-1).values)
        assert torch.allclose(d.full_logprobs.exp().sum(-1), torch.ones(t), atol=1e-5)
        if top_k:
            assert bool(torch.isinf(d.top_logprobs[:, top_k:]).all())  # outside the sampler's top-k


def test_greedy_records_a_point_mass(tiny):
    model, tok = tiny
    out = RolloutEngine(model, tok).generate(prompts_of(tok), max_new_tokens=6, temperature=0, top_logprobs=3)
    for s in out:
        assert s.distributions.top_ids[:, 0].tolist() == s.completion_ids
        assert bool((s.distributions.top_logprobs[:, 0] == 0).all())
        assert bool(torch.isinf(s.distributions.top_logprobs[:, 1:]).all())
        assert s.distributions.full_logprobs is None


@pytest.mark.parametrize("k", [-1, 10**6, True])
def test_bad_top_logprobs_is_named(tiny, k):
    model, tok = tiny
    with pytest.raises(ValueError, match="generate: top_logprobs="):
        RolloutEngine(model, tok).generate(prompts_of(tok), max_new_tokens=2, top_logprobs=k)
    with pytest.raises(ValueError, match="score_distributions: top_logprobs="):
        score_distributions(model, prompts_of(tok), [[5], [6]], top_logprobs=k)


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.7, 0.8, 6)])
def test_scorer_returns_the_processed_dense_distributions(tiny, temperature, top_p, top_k):
    model, tok = tiny
    prompts, completions = prompts_of(tok), [[70, 71, 72], [80] * 7]
    dists = score_distributions(
        model,
        prompts,
        completions,
        temperature,
        top_p,
        top_k,
        top_logprobs=5,
        full_logprobs=True,
        token_budget=1,
    )
    plain = score(model, prompts, completions, temperature)
    for c, d, lp in zip(completions, dists, plain, strict=True):
        assert d.full_logprobs.shape == (len(c), len(tok)) and d.top_ids.shape == (len(c), 5)
        assert torch.equal(d.top_logprobs, d.full_logprobs.topk(5, dim=-1).values)
        if top_k == 0 and top_p == 1.0:  # the tempered distribution is the one score() reads from
            drawn = d.full_logprobs.gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            assert torch.allclose(drawn, lp, atol=1e-6)
        else:  # the dense side is cut like the sampler's
            assert bool((torch.isfinite(d.full_logprobs).sum(-1) <= top_k).all())


# ---------------------------------------------------------------- alpha of real rollouts


def test_dense_sampler_gives_alpha_one_and_a_tight_budget_less(tiny):
    model, tok = tiny
    kw = dict(n=3, max_new_tokens=24, temperature=1.0, top_k=0, seed=1, ignore_eos=True)
    dense = measure_acceptance(model, tok, prompts_of(tok), KVConfig(), **kw)
    assert dense.exact.shape == dense.topk.shape == dense.positions.shape == (2 * 3 * 24,)
    assert (dense.exact - 1).abs().max() < DENSE_TOL
    assert bool((dense.topk <= dense.exact + 1e-6).all())
    lens = [len(p) for p in prompts_of(tok)]
    assert dense.positions[:24].tolist() == list(range(lens[0], lens[0] + 24))  # prompt length + index
    tight = measure_acceptance(model, tok, prompts_of(tok), KVConfig(method="streaming_llm", budget=14,
                                                                      window=4, interval=2), **kw)  # fmt: skip
    assert tight.exact.min() < 0.95
    assert bool((tight.topk <= tight.exact + 1e-6).all())


def test_samples_per_call_splits_n(tiny):
    model, tok = tiny
    kw = dict(max_new_tokens=5, ignore_eos=True, exact=False)
    split = measure_acceptance(model, tok, prompts_of(tok)[:1], KVConfig(), n=4, samples_per_call=3, **kw)
    three = measure_acceptance(model, tok, prompts_of(tok)[:1], KVConfig(), n=3, **kw)
    assert split.exact is None and split.topk.shape == (20,)
    assert torch.equal(split.topk[:15], three.topk)  # call 0: the first 3 samples, with `seed`
    assert not torch.equal(split.topk[15:], split.topk[:5])  # call 1 draws with another seed


def test_rollout_acceptance_needs_recorded_distributions(tiny):
    model, tok = tiny
    out = RolloutEngine(model, tok).generate(prompts_of(tok)[:1], max_new_tokens=3)
    with pytest.raises(
        ValueError, match="sample 0 has no recorded distributions; generate with top_logprobs"
    ):
        rollout_acceptance(model, prompts_of(tok)[:1], list(out))


# ---------------------------------------------------------------- training-time logging


def alpha_row(tmp_path: Path, *extra: str) -> dict:
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=1", "trainer.log_acceptance=true", *extra))
    trainer.train()
    return [r for r in rows(tmp_path / "run") if "reward/mean" in r][0]


def test_training_logs_alpha_one_when_dense(tmp_path: Path):
    row = alpha_row(tmp_path, "algo.preset=dense")
    assert row["alpha/tokens/bin0"] >= 20
    for stat in ("p5", "p1", "mean"):
        assert abs(row[f"alpha/exact/{stat}/bin0"] - 1) < DENSE_TOL
    assert row["alpha/exact/frac_below_tau/bin0"] == 0.0
    assert row["alpha/topk/p5/bin0"] <= row["alpha/exact/p5/bin0"] + 1e-6
    assert row["time/acceptance"] > 0


def test_training_logs_alpha_below_one_under_a_tight_budget(tmp_path: Path):
    row = alpha_row(tmp_path, "kv.method=streaming_llm", "kv.budget=14", "kv.window=4", "kv.interval=2")
    assert row["alpha/exact/p5/bin0"] < 0.99
    assert row["alpha/topk/p5/bin0"] <= row["alpha/exact/p5/bin0"] + 1e-6
    documented = set(re.findall(r"`(alpha/[a-z0-9_/<>|]+|time/acceptance)`", DOC.read_text()))
    for key in (k for k in row if k.startswith("alpha/") or k == "time/acceptance"):
        pattern = re.sub(r"bin\d+$", "bin<i>", key)
        assert pattern in documented, f"{key} is not in docs/metrics.md"


def test_training_without_the_flag_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    seen = []
    real = RolloutEngine.start_run
    monkeypatch.setattr(
        RolloutEngine,
        "start_run",
        lambda self, requests, sampling, recorder=None, *a, **kw: (
            seen.append(recorder) or real(self, requests, sampling, recorder, *a, **kw)
        ),
    )
    make_trainer(tiny_cfg(tmp_path, "trainer.steps=1")).train()
    assert seen and all(recorder is None for recorder in seen)
    assert not any(k.startswith("alpha/") for r in rows(tmp_path / "run") for k in r)


@pytest.mark.parametrize(
    ("override", "key"),
    [("trainer.acceptance_tau=1.5", "acceptance_tau"), ("trainer.acceptance_tau=0", "acceptance_tau"),
     ("trainer.acceptance_bin=0", "acceptance_bin"), ("trainer.acceptance_top_k=0", "acceptance_top_k")],
)  # fmt: skip
def test_bad_acceptance_config_names_the_key(tmp_path: Path, override: str, key: str):
    with pytest.raises(ConfigError, match=f"trainer.{key}="):
        tiny_cfg(tmp_path, override)


def test_a_top_k_larger_than_the_vocabulary_is_refused_at_start(tmp_path) -> None:
    from test_trainer import make_trainer, tiny_cfg

    from sparserl.config import ConfigError

    with pytest.raises(ConfigError, match="acceptance_top_k=100000 exceeds the vocabulary"):
        make_trainer(tiny_cfg(tmp_path, "trainer.log_acceptance=true", "trainer.acceptance_top_k=100000"))
