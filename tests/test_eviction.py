"""KV eviction on tiny models: a long prompt cut after prefill, memory allocated for the bound, a new method as one
registered class, bad input. What every registered method must do (the bound, the schedule and the positions held
at every step, dense equivalence, ragged batches) is tests/test_conformance_eviction.py; each method's own rule on
hand-made caches is tests/test_eviction_rules.py."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import pytest
import torch
import transformers

from sparserl.engine import EVICTION_METHODS, KVConfig, RolloutEngine, kv_methods
from sparserl.engine.compression import EvictionMethod, SlotView
from sparserl.models import ModelLoadError, tiny_model

GRANULARITIES = ("per_head", "shared")


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


# --- the prompt cut and memory ------------------------------------------------------------------------------


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
