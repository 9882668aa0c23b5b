"""The dense rollout engine on tiny models: sampler log-probs, determinism, batching, stops, sampling filters, input checks.

Tolerances are measured (fp32, CPU, torch 2.13) and documented in docs/engine.md. The sampler's per-token log-probs
come from our own decoder (one query per step against the preallocated cache, explicit softmax); the scorer's from
the model's own Hugging Face forward over the whole sequence (SDPA). Both are fp32 but sum in different orders, so
they differ by rounding: the max |diff| measured over 2 archs x 3 model seeds x 2 temperatures x 6 sampling seeds
x 6 samples x 32 tokens was 3.6e-5 (at temperature 0.7; 1.4e-5 at 1.0). The tiny models' logits reach |8| and a
log-prob at temperature T scales the logits' rounding by 1/T. AGREE_TOL = 1e-4 is ~3x the worst measured value and
far below any real error (a wrong position, a missed mask or a wrong temperature moves log-probs by >= 1e-2,
checked below) and below what matters for RL (an importance ratio off by exp(1e-4) - 1 = 1e-4).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from sparserl.engine import RolloutEngine, Rollouts, completion_logprobs, score
from sparserl.engine import decoding as rollout_mod
from sparserl.models import ModelLoadError, encode_prompt, load_model, tiny_model

AGREE_TOL = 1e-4  # sampler vs scorer log-probs: measured max 3.6e-5 (see module docstring)
BATCH_TOL = (
    1e-5  # the same computation in another batch (scorer log-probs, shared-KV log-probs): measured 1.9e-6
)
LOGIT_TOL = 1e-4  # engine logits of a row alone vs in a ragged batch (padding changes SDPA's blocking): measured 1.4e-5
ARCHS = ("llama", "qwen3")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request):
    return tiny_model(request.param, seed=0)


def chat(tok, text: str) -> list[int]:
    return encode_prompt(tok, [{"role": "user", "content": text}])


def prompts_of(tok) -> list[list[int]]:
    """Three prompts of different lengths (28, 38 and 66 tokens with the byte tokenizer)."""
    return [chat(tok, "Count: " + "ab" * k) for k in (1, 6, 20)]


def max_gap(rollouts: Rollouts, scored: list[torch.Tensor]) -> float:
    return max(float((s.logprobs - x).abs().max()) for s, x in zip(rollouts, scored, strict=True))


def score_rollouts(model, prompts, rollouts: Rollouts, temperature: float = 1.0) -> list[torch.Tensor]:
    return score(
        model, [prompts[s.prompt_index] for s in rollouts], [s.completion_ids for s in rollouts], temperature
    )


class LogitRecorder:
    """Wraps the engine's `sample_next` to keep the logits of every step (rows = alive samples, in order)."""

    def __init__(self, monkeypatch):
        self.steps: list[torch.Tensor] = []
        inner = rollout_mod.sample_next

        def spy(logits, *args, **kwargs):
            self.steps.append(logits.detach().clone())
            return inner(logits, *args, **kwargs)

        monkeypatch.setattr(rollout_mod, "sample_next", spy)


def no_eos(engine: RolloutEngine) -> RolloutEngine:
    engine.eos_ids = set()
    return engine


# ---------------------------------------------------------------- sampler / scorer agreement


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_match_scorer(tiny, temperature):
    model, tok = tiny
    prompts = prompts_of(tok)
    engine = RolloutEngine(model, tok)
    out = engine.generate(prompts, n=2, max_new_tokens=32, temperature=temperature, seed=3)
    assert [s.prompt_index for s in out] == [0, 0, 1, 1, 2, 2]
    scored = score_rollouts(model, prompts, out, temperature)
    assert max_gap(out, scored) < AGREE_TOL
    # the check can fail: scoring at the wrong temperature is far outside the tolerance
    wrong = score_rollouts(model, prompts, out, 1.0 if temperature != 1.0 else 0.5)
    assert max_gap(out, wrong) > 1e-2


def test_sampler_logprobs_are_normalised_and_negative(tiny):
    model, tok = tiny
    out = RolloutEngine(model, tok).generate(prompts_of(tok)[:1], n=4, max_new_tokens=16, seed=0)
    for s in out:
        assert s.logprobs.shape == (len(s.completion_ids),)
        assert s.logprobs.dtype == torch.float32
        assert bool((s.logprobs <= 0).all()) and bool(torch.isfinite(s.logprobs).all())


def hf_greedy(model, tok, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """transformers' own greedy continuation of one prompt (stopping at the same EOS ids as the engine)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos_ids),
        pad_token_id=tok.pad_token_id,
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_generate(tiny):
    """Our decoder forward and cache reproduce the model's own greedy decoding token for token."""
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    for prompt in prompts_of(tok):
        ours = engine.generate([prompt], max_new_tokens=24, temperature=0)[0]
        assert ours.completion_ids == hf_greedy(model, tok, prompt, 24, engine.eos_ids)
        assert bool((ours.logprobs == 0).all())  # greedy samples from a point mass


# ---------------------------------------------------------------- determinism


def test_same_seed_same_samples_other_seed_differs(tiny):
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    prompts = prompts_of(tok)
    a = engine.generate(prompts, n=3, max_new_tokens=20, seed=7)
    b = engine.generate(prompts, n=3, max_new_tokens=20, seed=7)
    c = engine.generate(prompts, n=3, max_new_tokens=20, seed=8)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]
    # the n samples of one prompt are not copies of each other
    assert len({tuple(s.completion_ids) for s in a}) > 1


def test_generate_does_not_touch_global_rng(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    RolloutEngine(model, tok).generate(prompts_of(tok)[:1], n=2, max_new_tokens=8, seed=1)
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------- batch composition, ragged prompts


def test_scorer_is_batch_composition_invariant(tiny):
    """A fixed completion scores the same alone, batched with longer prompts, or split into micro-batches."""
    model, tok = tiny
    short, *longer = prompts_of(tok)
    completion = tok("The answer is 42.")["input_ids"]
    others = [tok(" and so on" * k)["input_ids"] for k in (1, 5)]
    alone = score(model, [short], [completion])[0]
    batched = score(model, [*longer, short], [*others, completion], token_budget=10**6)[2]
    split = score(model, [*longer, short], [*others, completion], token_budget=1)[2]
    assert (alone - batched).abs().max() < BATCH_TOL
    assert (alone - split).abs().max() < BATCH_TOL
    logp, mask = completion_logprobs(model, [short, *longer], [completion, *others])
    assert (logp[0, : len(completion)] - alone).abs().max() < BATCH_TOL
    assert bool(mask[0, : len(completion)].all()) and not bool(mask[0, len(completion) :].any())
    # can fail: the same completion after another prompt scores differently
    assert (score(model, [longer[0]], [completion])[0] - alone).abs().max() > 1e-2


def test_ragged_prompts_match_each_prompt_alone(tiny, monkeypatch):
    """Greedy rows of a ragged batch produce the same tokens and next-token logits as each prompt alone."""
    model, tok = tiny
    prompts = [chat(tok, "hi"), chat(tok, "x" * 40), chat(tok, "a much longer question " * 3)]
    assert len({len(p) for p in prompts}) == 3
    engine = no_eos(RolloutEngine(model, tok))
    rec = LogitRecorder(monkeypatch)
    batched = engine.generate(prompts, max_new_tokens=16, temperature=0)
    batched_logits = torch.stack(rec.steps)  # [steps, rows, V]
    for i, p in enumerate(prompts):
        rec.steps.clear()
        alone = engine.generate([p], max_new_tokens=16, temperature=0)
        assert alone[0].completion_ids == batched[i].completion_ids
        gap = (torch.stack(rec.steps)[:, 0] - batched_logits[:, i]).abs().max()
        assert gap < LOGIT_TOL, f"prompt {i}: logits differ by {gap}"


# ---------------------------------------------------------------- shared prompt KV


def test_prompt_prefilled_once_for_its_n_samples(tiny, monkeypatch):
    model, tok = tiny
    engine = RolloutEngine(model, tok)
    seen: list[int] = []
    inner = engine._prefill

    def spy(prompt_ids, *args):
        seen.append(len(prompt_ids))
        return inner(prompt_ids, *args)

    monkeypatch.setattr(engine, "_prefill", spy)
    out = engine.generate(prompts_of(tok)[:2], n=4, max_new_tokens=4)
    assert seen == [2]  # two prompts prefilled, not eight rows
    assert [s.prompt_index for s in out] == [0] * 4 + [1] * 4


def test_shared_prompt_kv_equals_separate_prefills(tiny, monkeypatch):
    """n=4 samples of one prompt (one prefill, its KV held once) vs four copies of the prompt with n=1 (four prefills).

    The rows see identical logits either way, so with the same seed the sampler draws the same tokens; the
    logits of every step are compared too, and each completion is re-scored by teacher forcing.
    """
    model, tok = tiny
    prompt = prompts_of(tok)[1]
    engine = no_eos(RolloutEngine(model, tok))
    rec = LogitRecorder(monkeypatch)
    shared = engine.generate([prompt], n=4, max_new_tokens=24, seed=11)
    shared_logits = torch.stack(rec.steps)
    rec.steps.clear()
    separate = engine.generate([prompt] * 4, n=1, max_new_tokens=24, seed=11)
    separate_logits = torch.stack(rec.steps)
    assert (shared_logits - separate_logits).abs().max() < LOGIT_TOL
    assert [s.completion_ids for s in shared] == [s.completion_ids for s in separate]
    for a, b in zip(shared, separate, strict=True):
        assert (a.logprobs - b.logprobs).abs().max() < BATCH_TOL
    scored = score(model, [prompt] * 4, [s.completion_ids for s in shared])
    assert max_gap(shared, scored) < AGREE_TOL
    # the first-token distribution is the same for all four rows (they share one prefill)
    assert (shared_logits[0] - shared_logits[0, :1]).abs().max() == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_ids": []}, "prompt list is empty"),
        ({"prompt_ids": [[1, 2], []]}, "prompt 1 is empty"),
        ({"prompt_ids": [[1, 2]], "n": 0}, r"n \(0\)"),
        ({"prompt_ids": [[1, 2]], "max_new_tokens": 0}, r"max_new_tokens \(0\)"),
        (
            {"prompt_ids": [[1, 2], [5] * 4090], "max_new_tokens": 10},
            "prompt 1 has 4090 tokens.*context of 4096",
        ),
        ({"prompt_ids": [[1, 2], [3, 10**6]]}, "prompt 1 .*token id 1000000"),
        ({"prompt_ids": [[-1, 2]]}, "prompt 0 .*token id -1"),
        ({"prompt_ids": ["a text prompt"]}, "prompt 0 .*token ids"),
        ({"prompt_ids": [[1, 2]], "temperature": -0.5}, "temperature"),
        ({"prompt_ids": [[1, 2]], "top_p": 0.0}, "top_p"),
        ({"prompt_ids": [[1, 2]], "top_p": 1.5}, "top_p"),
        ({"prompt_ids": [[1, 2]], "top_k": -1}, "top_k"),
        ({"prompt_ids": [[1, 2]], "stop": ["ok", ""]}, "stop"),
    ],
)
def test_bad_generate_arguments_raise_naming_the_culprit(tiny, kwargs, message):
    model, tok = tiny
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        RolloutEngine(model, tok).generate(**kwargs)


def test_unknown_model_name_raises(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network retries in tests
    with pytest.raises(ModelLoadError, match="no-such-model-xyz"):
        load_model("no-such-model-xyz")
    with pytest.raises(ModelLoadError, match="not found.*missing.gguf"):
        load_model("/nonexistent/missing.gguf")


# fixed ids (not the random bytes): parallel workers must collect the same tests
@pytest.mark.parametrize(
    "content",
    [b"", b"garbage bytes, not a model" * 20, b"GGUF" + os.urandom(512)],
    ids=["empty", "garbage", "gguf-magic-then-random"],
)
def test_corrupt_gguf_raises(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=re.escape(str(path))):
        load_model(str(path))


def test_unsupported_architecture_raises():
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = tiny_model("llama")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok)))
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        RolloutEngine(gpt2, tok)
    with pytest.raises(ModelLoadError, match="unknown"):
        tiny_model("gpt2")


# ---------------------------------------------------------------- PEFT LoRA


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_runs_on_peft_lora_model(arch):
    from peft import LoraConfig, get_peft_model

    base, tok = tiny_model(arch, seed=2)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"],
                     init_lora_weights=False)  # fmt: skip
    model = get_peft_model(base, cfg)
    prompts = prompts_of(tok)[:2]
    out = RolloutEngine(model, tok).generate(prompts, n=2, max_new_tokens=20, seed=0)
    assert max_gap(out, score_rollouts(model, prompts, out)) < AGREE_TOL
    with model.disable_adapter():  # the adapter is live in the engine: without it the log-probs move
        assert max_gap(out, score_rollouts(model, prompts, out)) > 1e-2
    model.train()
    RolloutEngine(model, tok).generate(prompts, max_new_tokens=2)
    assert model.training  # generate restores the training mode


# ---------------------------------------------------------------- stats and docs


def test_stats_keys_are_documented(tiny):
    model, tok = tiny
    out = RolloutEngine(model, tok).generate(prompts_of(tok)[:1], n=2, max_new_tokens=6)
    doc = (ROOT / "docs" / "engine.md").read_text()
    keys = set(out.stats) | set(out[0].stats)
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"docs/engine.md does not describe stats keys {missing}"
    assert out.stats["prefill_s"] > 0 and out.stats["decode_s"] > 0 and out.stats["compress_s"] == 0
    assert out.stats["peak_kv_positions"] == len(prompts_of(tok)[0]) + 5
    assert out.stats["kv_bytes_per_position"] * out.stats["peak_kv_positions"] <= out.stats["peak_kv_bytes"]
    assert all(s.stats["retained_fraction"] == 1.0 and s.stats["compression_events"] == 0 for s in out)
