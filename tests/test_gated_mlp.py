"""The learner's SiLU-gated MLPs keep gate and up for the backward, not silu(gate) too (trainer/recompute.py
`fuse_gated_activations`): autograd's numbers bit for bit, fewer bytes kept."""

from __future__ import annotations

import copy

import torch
from torch import nn

from sparserl.engine.scoring import completion_logprobs
from sparserl.models import load_model
from sparserl.trainer.recompute import fuse_gated_activations
from tests.saved_tensors import kept_bytes

PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]]
COMPLETIONS = [[20, 21, 22], [23, 24, 25, 26, 27], [30, 31]]


def _pair() -> tuple[nn.Module, nn.Module]:
    """The tiny model, fully trainable, as it is and with its MLPs fused."""
    plain, _ = load_model("tiny-llama")
    plain.train().requires_grad_(True)
    fused = copy.deepcopy(plain)
    assert fuse_gated_activations(fused.model.layers)
    return plain, fused


def test_fused_mlps_give_autograds_numbers_bit_for_bit():
    plain, fused = _pair()
    want, mask = completion_logprobs(plain, PROMPTS, COMPLETIONS)
    got, _ = completion_logprobs(fused, PROMPTS, COMPLETIONS)
    assert torch.equal(got, want)
    (want * mask).sum().backward()
    (got * mask).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_fused_mlps_keep_one_intermediate_tensor_less_per_layer():
    plain, fused = _pair()
    cfg = plain.config
    # the silu(gate) autograd keeps: at least one float32 [tokens, intermediate] a layer over the completions
    least = cfg.num_hidden_layers * sum(len(c) for c in COMPLETIONS) * cfg.intermediate_size * 4
    assert kept_bytes(plain, PROMPTS, COMPLETIONS) - kept_bytes(fused, PROMPTS, COMPLETIONS) >= least


def test_only_silu_gated_mlps_of_known_classes_are_fused_and_copies_bind_their_own():
    plain, fused = _pair()
    replica = copy.deepcopy(fused)
    mlp = replica.model.layers[0].mlp
    assert mlp.forward.__self__ is mlp
    with torch.no_grad():  # without grad: the class forward, the same numbers
        x = torch.randn(2, 3, plain.config.hidden_size)
        assert torch.equal(mlp(x), plain.model.layers[0].mlp(x))
    relu = copy.deepcopy(plain)
    for layer in relu.model.layers:
        layer.mlp.act_fn = nn.ReLU()
    assert not fuse_gated_activations(relu.model.layers)
    assert "forward" not in vars(relu.model.layers[0].mlp)
    assert not fuse_gated_activations(nn.ModuleList([nn.Linear(2, 2)]))
