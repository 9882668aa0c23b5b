"""The sampler: inverse-CDF draws at per-sample uniform numbers (engine/sampling.py). It must draw exactly the
processed distribution, never a removed token, and give a sample the same tokens whatever shares its batch."""

from __future__ import annotations

import pytest
import torch

from sparserl.engine import RolloutEngine
from sparserl.engine.sampling import draw, processed_logprobs, sample_next, sample_uniforms
from sparserl.models import encode_prompt, tiny_model

# chi-square critical value at p = 0.001 for 4 degrees of freedom: a correct sampler exceeds it once in 1000
# seeds; the seed is fixed, so the test is deterministic (statistic 2.3 at the time of writing).
CHI2_CRIT_DF4 = 18.47


@pytest.mark.parametrize("block", [4, 256])  # 4: two levels, with a padded last block; 256: one block
def test_draws_follow_the_distribution(block):
    """60,000 draws from a 6-id distribution with one removed id: chi-square against the probabilities."""
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
    draws = 60_000
    tokens = draw(probs.expand(draws, -1), sample_uniforms(0, range(draws), 1)[:, 0], block=block)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[2] == 0  # a zero-probability id is never drawn
    live = probs > 0
    expected = probs[live].double() * draws
    chi2 = float(((counts[live] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRIT_DF4


def test_a_biased_sampler_fails_the_same_check():
    """The check can fail: draws from a distribution 2% off on two ids exceed the critical value."""
    probs, off = torch.tensor([0.05, 0.3, 0.15, 0.4, 0.1]), torch.tensor([0.05, 0.32, 0.13, 0.4, 0.1])
    tokens = draw(off.expand(60_000, -1), sample_uniforms(0, range(60_000), 1)[:, 0])
    expected = probs.double() * 60_000
    chi2 = float(((torch.bincount(tokens, minlength=5).double() - expected) ** 2 / expected).sum())
    assert chi2 > CHI2_CRIT_DF4


def test_uniforms_are_a_function_of_seed_key_and_step():
    table = sample_uniforms(7, range(10), 5)
    assert table.dtype == torch.float64 and table.shape == (10, 5)
    assert torch.equal(sample_uniforms(7, [9, 3], 5), table[[9, 3]])  # a key's stream ignores the others
    assert torch.equal(sample_uniforms(7, [3], 3)[0], table[3, :3])  # and the number of steps
    assert not torch.equal(sample_uniforms(8, range(10), 5), table)
    many = sample_uniforms(0, range(1000), 100).flatten()
    assert float(many.min()) >= 0 and float(many.max()) < 1
    histogram = torch.histc(many.float(), bins=10, min=0, max=1)  # 10,000 per decile expected
    assert float((histogram - 10_000).abs().max()) < 500  # ~5 standard deviations


@pytest.mark.parametrize(("top_p", "top_k"), [(0.8, 0), (1.0, 3), (0.5, 5)])
def test_never_draws_outside_top_k_top_p(top_p, top_k):
    logits = torch.randn(500, 40, generator=torch.Generator().manual_seed(1)) * 3
    uniforms = sample_uniforms(3, range(500), 1)[:, 0]
    tokens, logp, dist = sample_next(logits, uniforms, 1.0, top_p, top_k, with_distribution=True)
    assert torch.isfinite(logp).all()
    assert torch.equal(logp, dist.gather(-1, tokens[:, None]).squeeze(-1))
    # the same distribution as the scorer's processing, up to float32 rounding of the normaliser
    assert torch.allclose(dist, processed_logprobs(logits, 1.0, top_p, top_k), atol=1e-5, rtol=0)


def test_a_sample_keeps_its_tokens_in_another_batch():
    """Per-sample randomness: with the same key a sample draws the same tokens alone and beside others."""
    model, tok = tiny_model("llama", seed=0)
    engine = RolloutEngine(model, tok)
    engine.eos_ids = set()
    a, b = (encode_prompt(tok, [{"role": "user", "content": text}]) for text in ("abab", "cdcd"))
    alone = engine.generate([a], n=2, max_new_tokens=24, seed=5, sample_keys=[11, 12])
    beside = engine.generate([b, a], n=2, max_new_tokens=24, seed=5, sample_keys=[1, 2, 11, 12])
    assert [s.completion_ids for s in alone] == [s.completion_ids for s in beside][2:]
    default = engine.generate([b, a], n=2, max_new_tokens=24, seed=5)  # keys 0-3: other draws for a
    assert [s.completion_ids for s in default][2:] != [s.completion_ids for s in alone]


def test_bad_sample_keys_are_refused():
    model, tok = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="sample_keys must be 2 integers"):
        RolloutEngine(model, tok).generate([[1, 2, 3]], n=2, max_new_tokens=2, sample_keys=[1])
