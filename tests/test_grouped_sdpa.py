"""Grouped-head attention for teacher-forced passes (sparserl/grouped_sdpa.py): transformers' sdpa numbers, without
the KV heads repeated per query head."""

from __future__ import annotations

import copy

import torch

from sparserl.engine.scoring import completion_logprobs
from sparserl.grouped_sdpa import GROUPED_SDPA, use_grouped_sdpa
from sparserl.models import load_model, tiny_model
from tests.saved_tensors import kept_bytes

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12, 13]]
COMPLETIONS = [[20, 21, 22, 23], [24, 25], [30, 31, 32]]  # a shared prompt, ragged rows: masks on every path


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model as `load_model` gives it (grouped) and the same weights on transformers' sdpa."""
    grouped, _ = load_model("tiny-llama")
    plain = copy.deepcopy(grouped)
    plain.set_attn_implementation("sdpa")
    return grouped.train(), plain.train()


def test_load_model_switches_grouped_models_only():
    grouped, _ = load_model("tiny-llama")
    assert grouped.config.num_key_value_heads < grouped.config.num_attention_heads
    assert grouped.config._attn_implementation == GROUPED_SDPA
    eager = copy.deepcopy(grouped)
    eager.set_attn_implementation("eager")
    assert not use_grouped_sdpa(eager) and eager.config._attn_implementation == "eager"
    model, _ = tiny_model("llama", seed=0)
    model.config.num_key_value_heads = model.config.num_attention_heads  # not grouped: nothing to gain
    assert not use_grouped_sdpa(model) and model.config._attn_implementation == "sdpa"


def test_same_logprobs_and_gradients_as_transformers_sdpa():
    grouped, plain = _pair()
    got, mask = completion_logprobs(grouped, PROMPTS, COMPLETIONS)
    want, _ = completion_logprobs(plain, PROMPTS, COMPLETIONS)
    assert torch.equal(got, want)  # the same kernel over the same numbers: the forward is bit for bit
    (got * mask).sum().backward()
    (want * mask).sum().backward()
    for (name, a), b in zip(grouped.named_parameters(), plain.parameters(), strict=True):
        # the key and value projections' gradients sum the query heads' shares in another order (measured on
        # this model: <= 2e-7 relative); every other gradient is bit for bit or within that rounding
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_backward_keeps_keys_and_values_once_per_kv_head():
    grouped, plain = _pair()
    saved, repeated = kept_bytes(grouped, PROMPTS, COMPLETIONS), kept_bytes(plain, PROMPTS, COMPLETIONS)
    cfg = grouped.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # the plain pass keeps every layer's keys and values repeated to the query heads: (groups - 1) extra copies
    # of each [rows, kv_heads, positions, head_dim] float32 tensor; the grouped pass keeps none of them
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    rows_positions = sum(len(c) for c in COMPLETIONS)  # at least this many key positions per layer
    least = cfg.num_hidden_layers * 2 * (groups - 1) * cfg.num_key_value_heads * rows_positions * head_dim * 4
    assert repeated - saved >= least


def test_a_switched_model_runs_in_a_process_that_never_switched_one(tmp_path):
    """A Ray learner rank or rollout worker receives the model pickled: importing sparserl's trainer registers the
    attention there (a fresh interpreter, no `use_grouped_sdpa` call)."""
    import pickle
    import subprocess
    import sys

    grouped, _ = load_model("tiny-llama")
    (tmp_path / "model.pkl").write_bytes(pickle.dumps(grouped))
    code = (
        "import pickle, sys, torch, sparserl.trainer.learner_group\n"
        f"m = pickle.loads(open({str(tmp_path / 'model.pkl')!r}, 'rb').read())\n"
        "assert m.config._attn_implementation == 'sparserl_grouped_sdpa'\n"
        "m(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 1, 1]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
