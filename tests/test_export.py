"""The merged export (trainer/export.py) against peft's merge_and_unload on a deep copy: the same tensors bit for
bit once read back by `from_pretrained`, in one file or in shards with their index, the distill adapter left
out, and no copy of the model held while writing."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer, tiny_cfg
from transformers import AutoModelForCausalLM

from sparserl.trainer.export import merged_weights, save_merged


def lora_policy(tmp_path: Path, *extra: str):
    trainer = make_trainer(tiny_cfg(tmp_path, "model.lora=true", "model.lora_r=4", *extra))
    peft = trainer.policy.peft
    with torch.no_grad():  # trained-looking adapters: B is zero at initialisation, which would merge nothing
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return trainer.policy


def peft_export(policy, path: Path) -> Path:
    merged = copy.deepcopy(policy.peft).merge_and_unload(adapter_names=policy.own_adapters)
    merged.save_pretrained(path)
    return path


@pytest.mark.parametrize("shard_bytes", [10**9, 20_000], ids=["one-file", "shards"])
def test_the_export_equals_peft_merge_and_unload(tmp_path: Path, shard_bytes: int) -> None:
    policy = lora_policy(tmp_path)
    ours = tmp_path / "ours"
    ours.mkdir()
    save_merged(policy.peft, policy.own_adapters, ours, shard_bytes)
    if shard_bytes < 10**9:
        index = json.loads((ours / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
    a = AutoModelForCausalLM.from_pretrained(ours).state_dict()
    b = AutoModelForCausalLM.from_pretrained(peft_export(policy, tmp_path / "peft")).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    base = policy.peft.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], base)  # the adapter really merged
    assert json.loads((ours / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_merged_weights_are_computed_one_at_a_time(tmp_path: Path) -> None:
    """Nothing is merged until asked, and a merged weight is a new tensor (the live weight is untouched)."""
    policy = lora_policy(tmp_path)
    weights = merged_weights(policy.peft, policy.own_adapters)
    assert not any(".lora_" in name or ".base_layer." in name for name in weights)
    q = policy.peft.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    before = q.detach().clone()
    fn, size = weights["model.layers.0.self_attn.q_proj.weight"]
    merged = fn()
    assert size == q.numel() * q.element_size() and merged.data_ptr() != q.data_ptr()
    assert torch.equal(q, before)


def test_the_distill_adapter_is_left_out(tmp_path: Path) -> None:
    policy = lora_policy(tmp_path, "distill.enable=true", "kv.method=block_topk", "kv.budget=48",
                         "kv.page_size=16", "algo.preset=tis")  # fmt: skip
    assert policy.distill_adapter and policy.distill_adapter not in policy.own_adapters
    out = tmp_path / "ours"
    out.mkdir()
    save_merged(policy.peft, policy.own_adapters, out)
    a = AutoModelForCausalLM.from_pretrained(out).state_dict()
    b = AutoModelForCausalLM.from_pretrained(peft_export(policy, tmp_path / "peft")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
