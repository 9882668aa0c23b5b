"""KV eviction on tiny models: the bound at every step, the schedule, true positions, dense equivalence, each
method's rule on hand-made caches, per-sequence budgets in ragged batches, bad input.

Every decode step is observed through a `RolloutEngine` step hook. The expected number of held positions of a
sequence is simulated from the documented schedule: a prompt longer than `budget` is cut to `budget` after
prefill; after every `interval`-th decode step a sequence that held `budget` or more before the step holds
exactly `budget`; otherwise it grows by one.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparserl.engine import EVICTION_METHODS, KVConfig, RolloutEngine, kv_methods
from sparserl.engine.cache import KVCache
from sparserl.engine.compression import EvictionMethod, SlotView
from sparserl.engine.evicting_prefix import EvictingPrefixCache
from sparserl.models import ModelLoadError, tiny_model

GRANULARITIES = ("per_head", "shared")
KEY_TOL = 1e-5  # a cached key vs the same key recomputed alone (batched vs single-row matmuls): ~1e-6


@functools.cache
def tiny(arch: str = "llama"):
    return tiny_model(arch, seed=0)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 250, (n,), generator=g).tolist() for n in lengths]


def engine(
    kv: KVConfig | None, arch: str = "llama", eos: bool = False, share_prompts: bool = True
) -> RolloutEngine:
    model, tok = tiny(arch)
    e = RolloutEngine(model, tok, kv=kv, share_prompts=share_prompts)
    if not eos:
        e.eos_ids = set()
    return e


def layer0_keys(e: RolloutEngine, ids: list[int]) -> torch.Tensor:
    """Layer-0 keys [Hkv, T, D] of a sequence computed alone at positions 0..T-1 (they depend on token and
    position only), to check that a cached key was rotated by its true position."""
    dec = e.decoder
    x = torch.tensor(ids)[None]
    hidden = dec.embed(x)
    rope = dec.rope(hidden, torch.arange(len(ids))[None])
    return dec.qkv(0, hidden, rope).k[0]


# --- the bound, the schedule and true positions, at every step ---------------------------------------------


class StepChecker:
    """A step hook asserting, after every decode step, the bound, the schedule and the held positions."""

    def __init__(self, kv: KVConfig, prompt_lens: list[int], n: int, max_new: int):
        self.kv = kv
        self.prompt = [p for p in prompt_lens for _ in range(n)]
        self.held = [min(p, kv.budget) for p in self.prompt]  # a long prompt is cut right after prefill
        self.capacity = min(kv.budget + kv.interval - 1, max(prompt_lens) + max_new)
        self.steps = 0
        self.last: tuple | None = None

    def __call__(self, step: int, cache: KVCache, samples: torch.Tensor) -> None:
        kv = self.kv
        assert step == self.steps
        self.steps += 1
        if isinstance(cache, EvictingPrefixCache):  # own rows grow by blocks, never past the bound
            assert cache.capacity <= self.capacity
        else:
            assert cache.capacity == self.capacity
        assert all(t.shape[2] == cache.capacity for t in cache.k + cache.v + cache.pos)
        assert int(cache.held().max()) <= kv.budget + kv.interval - 1
        slots = [cache.eviction_slots(layer, slice(None)) for layer in range(cache.num_layers)]
        for row, s in enumerate(samples.tolist()):
            if (step + 1) % kv.interval == 0 and self.held[s] >= kv.budget:
                self.held[s] = kv.budget - 1  # cut so that the step's token makes exactly `budget`
            self.held[s] += 1
            held = int(cache.held()[row])
            assert held == self.held[s], (step, s, held, self.held[s])
            total = self.prompt[s] + step + 1  # positions fed so far; the newest is total - 1
            for layer in range(cache.num_layers):
                pos = slots[layer][1][row, :, :held].long()  # [Hkv, held], the prompt's held slots first
                assert (pos[:, 1:] > pos[:, :-1]).all(), "held positions are unique and chronological"
                assert pos.min() >= 0 and pos.max() == total - 1
                recent = torch.arange(max(0, total - kv.window), total)
                assert (pos[:, -len(recent) :] == recent).all(), "the last `window` positions are held"
                if kv.method == "streaming_llm":
                    sinks = torch.arange(min(kv.n_sink, total))
                    assert (pos[:, : len(sinks)] == sinks).all()
                if kv.granularity == "shared":
                    assert (pos == slots[0][1][row, :1, :held].long()).all(), "one set for all heads, layers"
        keys, pos, _, held = slots[0]
        self.last = (step, keys.clone(), pos.clone(), held.clone(), samples.clone())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    method=st.sampled_from(tuple(EVICTION_METHODS)),
    granularity=st.sampled_from(GRANULARITIES),
    window=st.integers(1, 6),
    spare=st.integers(1, 12),
    interval=st.integers(1, 9),
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    n=st.integers(1, 2),
    max_new=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    share=st.booleans(),
)
def test_bound_schedule_and_positions_hold_at_every_step(
    method, granularity, window, spare, interval, prompt_lens, n, max_new, seed, share
):
    """Rows holding a copy of their prompt, or reading it held once (`share`: a mask over the cut prompt and
    their own slots; H2O's per-slot state keeps copies): the bound, schedule and positions of the held set."""
    sinks = 4 if method == "streaming_llm" else 0
    kv = KVConfig(
        method=method,
        budget=window + sinks + spare,
        window=window,
        interval=interval,
        granularity=granularity,
        seed=seed,
    )
    e = engine(kv, share_prompts=share)
    check = StepChecker(kv, prompt_lens, n, max_new)
    e.step_hooks.append(check)
    prompts = random_prompts(prompt_lens, seed)
    out = e.generate(prompts, n=n, max_new_tokens=max_new, seed=seed)
    assert check.steps == max_new - 1  # the last sampled token is never fed
    bound = kv.budget + kv.interval - 1
    assert out.stats["peak_kv_positions"] <= bound
    assert max(s.stats["kv_peak_positions"] for s in out) == out.stats["peak_kv_positions"]
    per_position = out.stats["kv_bytes_per_position"]
    decode_bytes = len(prompts) * n * check.capacity * per_position
    prefill_bytes = len(prompts) * max(prompt_lens) * per_position  # the prompts' cache, until it is copied
    if not e.share_prompts or n == 1:  # copies: every row allocated the bound
        assert out.stats["peak_kv_bytes"] == decode_bytes
        assert out.stats["peak_kv_transient_bytes"] == decode_bytes + prefill_bytes
    if check.last is None:
        return
    # RoPE saw the true positions: each held layer-0 key equals the key recomputed at its position.
    step, k0, pos0, length, samples = check.last
    for row, s in enumerate(samples.tolist()):
        ids = prompts[s // n] + out[s].completion_ids[: step + 1]
        fresh = layer0_keys(e, ids)  # [Hkv, T, D]
        held = int(length[row])
        idx = pos0[row, :, :held].long()
        expected = torch.gather(fresh, 1, idx[..., None].expand(-1, -1, fresh.shape[-1]))
        torch.testing.assert_close(k0[row, :, :held], expected, atol=KEY_TOL, rtol=0)


def test_long_prompt_is_cut_to_budget_right_after_prefill():
    kv = KVConfig(method="snapkv", budget=16, window=4, interval=8)
    e = engine(kv)
    seen = []
    e.step_hooks.append(lambda step, cache, samples: seen.append(cache.length.tolist()))
    out = e.generate(random_prompts([40, 10], 0), n=1, max_new_tokens=5)
    assert seen[0] == [17, 11]  # budget + the first generated token; the short prompt is untouched
    assert [s.stats["compression_events"] for s in out] == [1, 0]


def test_memory_is_allocated_for_the_bound_not_the_length():
    kv = KVConfig(method="rkv", budget=24, window=4, interval=8)
    out = engine(kv, share_prompts=False).generate(random_prompts([6], 0), n=3, max_new_tokens=120)
    dense = engine(None).generate(random_prompts([6], 0), n=3, max_new_tokens=120)
    per_position = out.stats["kv_bytes_per_position"]
    assert out.stats["peak_kv_bytes"] == 3 * (24 + 8 - 1) * per_position
    assert dense.stats["peak_kv_bytes"] == (6 + 3 * 120) * per_position  # the group's prompt held once
    # plus the prompt's prefilled 6 positions while they are copied to the samples
    assert out.stats["peak_kv_transient_bytes"] == (3 * (24 + 8 - 1) + 6) * per_position
    assert out.stats["peak_kv_positions"] == 24 + 8 - 1
    assert out.stats["compression_events"] == 3 * 12  # after steps 24, 32, ..., 112
    held, fractions = 6, []  # the schedule, simulated: held / total positions after each decode step
    for step in range(119):
        held = 23 if (step + 1) % 8 == 0 and held >= 24 else held
        held += 1
        fractions.append(held / (6 + step + 1))
    assert out.stats["retained_fraction"] == pytest.approx(sum(fractions) / len(fractions), rel=1e-5)
    assert 0 < out.stats["compress_s"] < out.stats["decode_s"]


# --- exactness at a large budget ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", EVICTION_METHODS)
def test_large_budget_equals_dense(method, granularity, arch):
    prompts = random_prompts([23, 5, 12], 1)
    kv = KVConfig(method=method, budget=64, window=4, interval=3, granularity=granularity)
    e = engine(kv, arch)
    sparse = e.generate(prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7)
    # the dense engine holding each group's prompt as the evicting one does: once, or copied (H2O)
    dense = engine(None, arch, share_prompts=e.share_prompts).generate(
        prompts, n=2, max_new_tokens=24, temperature=1.0, seed=7
    )
    assert sparse.stats["compression_events"] == 0
    for a, b in zip(sparse, dense, strict=True):
        assert a.completion_ids == b.completion_ids
        assert torch.equal(a.logprobs, b.logprobs)


# --- per-sequence budgets in a ragged batch ---------------------------------------------------------------------


@functools.cache
def eos_prone_model():
    """The tiny model with its EOS logit raised, so that greedy samples end at different steps."""
    model, tok = tiny_model("llama", seed=0)
    bias = torch.zeros(model.lm_head.weight.shape[0])
    bias[tok.eos_token_id] = 1.5
    model.lm_head.bias = torch.nn.Parameter(bias)
    return model, tok


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("method", EVICTION_METHODS)
def test_ragged_batch_compresses_each_sequence_as_if_alone(method, granularity):
    """Prompts of 3 to 40 tokens with a budget of 16, samples ending at different times: every sequence follows
    the schedule from its own length (padding never counts), and each prompt's greedy completion and statistics
    are those of the prompt run alone, so neighbours never use or free a sequence's budget. (`random` draws its
    scores for the whole batch at once, so only the schedule is compared for it.)"""
    model, tok = eos_prone_model()
    kv = KVConfig(method=method, budget=16, window=4, interval=5, granularity=granularity)
    e = RolloutEngine(model, tok, kv=kv)
    lens = [3, 40, 17, 9, 25]
    prompts = random_prompts(lens, 1)
    check = StepChecker(kv, lens, n=1, max_new=48)
    e.step_hooks.append(check)
    batch = e.generate(prompts, n=1, max_new_tokens=48, temperature=0)
    e.step_hooks.clear()
    lengths = [len(s.completion_ids) for s in batch]
    assert len(set(lengths)) >= 3 and "stop" in {s.finish_reason for s in batch}  # they end apart
    assert max(s.stats["compression_events"] for s in batch) >= 3
    assert check.steps == max(lengths) - 1
    if method == "random":
        return
    for i, p in enumerate(prompts):
        alone = e.generate([p], n=1, max_new_tokens=48, temperature=0)[0]
        assert batch[i].completion_ids == alone.completion_ids, i
        assert batch[i].stats == alone.stats, i


# --- a new method is one file -----------------------------------------------------------------------------------


def test_a_registered_method_is_a_kv_method():
    """Registering a class is all a new eviction method needs: kv.method accepts it as an evicting method and
    the engine compresses with it; once it is gone, the name is refused again."""

    @EVICTION_METHODS.register("newest")
    class Newest(EvictionMethod):
        """Keep the most recent positions."""

        def score(self, view: SlotView) -> torch.Tensor:
            return view.positions.float()

    try:
        kv = KVConfig(method="newest", budget=16, window=4, interval=4)
        assert kv.evicting and "newest" in kv_methods()
        batch = engine(kv).generate(random_prompts([20], 1), n=1, max_new_tokens=12, seed=0)
        assert batch.stats["compression_events"] > 0
    finally:
        del EVICTION_METHODS["newest"]
    with pytest.raises(ValueError, match="kv.method='newest'"):
        KVConfig(method="newest")


def test_method_lists_in_help_come_from_the_registries():
    """kv.method's help names every registered method, and no command's help writes out its own list (the
    eviction methods' names appear in sparserl/cli only in examples, never beside each other)."""
    method_help = next(f.metadata["help"] for f in dataclasses.fields(KVConfig) if f.name == "method")
    assert all(name in method_help for name in kv_methods())
    cli = Path(__file__).resolve().parent.parent / "sparserl" / "cli"
    for path in sorted(cli.glob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            listed = [name for name in EVICTION_METHODS if re.search(rf"\b{name}\b", line)]
            assert len(listed) < 2, f"{path.name}:{lineno} lists kv.method names by hand: {line.strip()}"


# --- bad input -----------------------------------------------------------------------------------------------


def test_budget_must_exceed_the_always_kept_positions():
    with pytest.raises(ValueError, match=r"kv.budget=8 .*window 8"):
        KVConfig(method="snapkv", budget=8, window=8)
    with pytest.raises(ValueError, match=r"kv.budget=12 .*window 8 \+ 4 sinks"):
        KVConfig(method="streaming_llm", budget=12, window=8)
    KVConfig(method="streaming_llm", budget=13, window=8)
    KVConfig(method="dense", budget=1, window=8)  # dense ignores the budget


def test_unknown_method_and_granularity_are_named():
    with pytest.raises(ValueError, match=r"kv.method='snap'.*rkv, snapkv"):
        KVConfig(method="snap")
    with pytest.raises(ValueError, match=r"kv.granularity='per_layer'"):
        KVConfig(method="rkv", granularity="per_layer")


@pytest.mark.parametrize(
    ("key", "value"), [("pool_kernel", 4), ("pool_kernel", 0), ("rkv_lambda", 1.5), ("n_sink", -1)]
)
def test_bad_method_knobs_are_named(key, value):
    with pytest.raises(ValueError, match=rf"kv.{key}={value}"):
        KVConfig(method="rkv", **{key: value})


def test_unsupported_attention_is_refused():
    _, tok = tiny()
    cfg = transformers.AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok), bos_token_id=1, eos_token_id=2
    )
    gpt2 = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        RolloutEngine(gpt2, tok, kv=KVConfig(method="rkv", budget=64))
