"""`optim.recompute_modules` 'layernorm' and 'mlp_act': the learner's norm outputs and MLP product are recomputed
in the backward, not kept (trainer/recompute.py `recompute_cheap_saves`): autograd's numbers bit for bit, those
tensors freed after the forward."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

from sparserl.engine.scoring import completion_logprobs
from sparserl.models import load_model
from sparserl.trainer.recompute import fuse_gated_activations, recompute_cheap_saves
from tests.saved_tensors import kept_bytes

PROMPTS = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]]
COMPLETIONS = [[20, 21, 22], [23, 24, 25, 26, 27], [30, 31]]
BOTH = ("layernorm", "mlp_act")


def _lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return get_peft_model(model, lora)


def _pair(lora: bool) -> tuple[nn.Module, nn.Module, nn.ModuleList]:
    """The tiny model (LoRA or fully trainable), its MLPs fused, as it is and with the saves recomputed."""
    model, _ = load_model("tiny-llama")
    if lora:
        model = _lora(model)
    else:
        model.requires_grad_(True)
    model.train()
    layers = (model.base_model.model if lora else model).model.layers
    fuse_gated_activations(layers)
    recomputing = copy.deepcopy(model)
    inner = (recomputing.base_model.model if lora else recomputing).model.layers
    assert recompute_cheap_saves(inner, BOTH) == len(inner)
    return model, recomputing, inner


@pytest.mark.parametrize("lora", [True, False])
def test_recomputed_saves_give_autograds_numbers_bit_for_bit(lora):
    plain, recomputing, layers = _pair(lora)
    want, mask = completion_logprobs(plain, PROMPTS, COMPLETIONS)
    got, _ = completion_logprobs(recomputing, PROMPTS, COMPLETIONS)
    assert torch.equal(got, want)
    (want * mask).sum().backward()
    (got * mask).sum().backward()
    grads = [(n, p.grad) for n, p in plain.named_parameters() if p.requires_grad]
    assert grads
    for (name, a), b in zip(
        grads, [p.grad for p in recomputing.parameters() if p.requires_grad], strict=True
    ):
        assert torch.equal(a, b), name
    assert all(layer._recomputed_saves.recomputed > 0 for layer in layers)  # the recipes did run


@pytest.mark.parametrize("recompute", [False, True])
def test_the_mlp_product_and_norm_outputs_are_not_kept_for_the_backward(recompute):
    plain, recomputing, _ = _pair(lora=True)
    model = recomputing if recompute else plain
    layer = model.base_model.model.model.layers[0]
    outputs: list[weakref.ref] = []
    for module, of_input in ((layer.mlp.down_proj, True), (layer.input_layernorm, False)):
        module.register_forward_hook(
            lambda _m, args, out, of_input=of_input: outputs.append(weakref.ref(args[0] if of_input else out))
        )
    logp, mask = completion_logprobs(model, PROMPTS, COMPLETIONS)
    gc.collect()
    alive = [r() is not None for r in outputs]
    assert alive == [not recompute] * len(outputs)
    (logp * mask).sum().backward()  # the backward still runs once they are gone


def test_outside_training_the_class_forwards_run_and_copies_bind_their_own():
    plain, recomputing, layers = _pair(lora=False)
    replica = copy.deepcopy(layers)
    norm = replica[0].input_layernorm
    assert norm.forward.__self__ is norm and replica[0]._recomputed_saves is norm._recomputed_saves
    assert replica[0]._recomputed_saves is not layers[0]._recomputed_saves
    with torch.no_grad():
        got, _ = completion_logprobs(recomputing, PROMPTS, COMPLETIONS)
        want, _ = completion_logprobs(plain, PROMPTS, COMPLETIONS)
    assert torch.equal(got, want)
    assert layers[0]._recomputed_saves.recomputed == 0
    assert recompute_cheap_saves(nn.ModuleList([nn.Linear(2, 2)]), BOTH) == 0


def test_the_forward_keeps_the_product_and_the_norm_outputs_less_and_nothing_else():
    plain, recomputing, layers = _pair(lora=True)
    cfg = plain.config
    less = kept_bytes(plain, PROMPTS, COMPLETIONS) - kept_bytes(recomputing, PROMPTS, COMPLETIONS)
    # at least the MLP product over the completions, one float32 [tokens, intermediate] a layer; at most it and
    # the two norm outputs over every prompt and completion token
    least = len(layers) * sum(len(c) for c in COMPLETIONS) * cfg.intermediate_size * 4
    tokens = sum(len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True))
    most = len(layers) * tokens * (cfg.intermediate_size + 2 * cfg.hidden_size) * 4
    assert least <= less <= most


def test_only_the_named_saves_are_recomputed_and_only_when_asked(tmp_path):
    from sparserl.engine.decoder import causal_lm
    from tests.test_trainer import make_trainer, tiny_cfg

    def bound(name: str, *extra: str) -> list[bool]:
        trainer = make_trainer(tiny_cfg(tmp_path, *extra, name=name))
        layer = causal_lm(trainer.policy.module).model.layers[0]
        got = [
            "forward" in vars(layer),
            "forward" in vars(layer.input_layernorm),
            getattr(layer.mlp, "_recomputed_saves", None) is not None,
        ]
        trainer.close()
        return got

    assert bound("default") == [False, False, False]  # the default keeps them: speed first
    assert bound("act", "optim.recompute_modules=[mlp_act]") == [True, False, True]
    assert bound("both", "optim.recompute_modules=[layernorm,mlp_act]") == [True, True, True]
