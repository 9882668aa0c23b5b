"""The policy as a standalone Hugging Face folder with its own LoRA adapters merged, written shard by shard.

Why not peft's `merge_and_unload` on a deep copy of the model, then `save_pretrained`: the copy holds the whole
model a second time at the end of every run (its resident peak in the default run: docs/engine.md). Here each
merged weight (the base weight plus each adapter's `get_delta_weight`, the sum `merge_and_unload` makes) is
computed when its shard is written and freed after it: the export holds at most one shard beyond the model.
The files are what `save_pretrained` writes (safetensors shards with their index, the config, the generation
config), read back by `from_pretrained` (tested equal to peft's merge).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from torch import Tensor, nn

SHARD_BYTES = 100 * 2**20  # merged weights held at once while exporting


def merged_weights(
    peft_model: nn.Module, adapters: Sequence[str]
) -> dict[str, tuple[Callable[[], Tensor], int]]:
    """The unwrapped model's tensors by name (as `merge_and_unload` would name them), each with a function giving
    it and its bytes: a LoRA layer's weight merged with `adapters` (a new tensor of the base weight's size and
    dtype), any other tensor as it is. Adapter tensors are left out, and a tensor sharing storage with one named
    before (tied embeddings) is named once."""
    base = peft_model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    out: dict[str, tuple[Callable[[], Tensor], int]] = {}
    seen: set[int] = set()
    for key, tensor in base.state_dict(keep_vars=True).items():
        if ".lora_" in key:
            continue
        module, _, leaf = key.rpartition(".base_layer.")
        name, size = (f"{module}.{leaf}" if module else key), tensor.numel() * tensor.element_size()
        if module in layers and leaf == "weight":
            out[name] = (_merged(layers[module], [a for a in adapters if a in layers[module].lora_A]), size)
        elif tensor.untyped_storage().data_ptr() not in seen:
            out[name] = (tensor.detach, size)
        seen.add(tensor.untyped_storage().data_ptr())
    return out


def _merged(layer: LoraLayer, adapters: list[str]) -> Callable[[], Tensor]:
    def weight() -> Tensor:
        w = layer.get_base_layer().weight.detach().clone()
        for adapter in adapters:
            w += layer.get_delta_weight(adapter).to(w.dtype)
        return w

    return weight


def save_merged(
    peft_model: nn.Module, adapters: Sequence[str], path: Path, shard_bytes: int = SHARD_BYTES
) -> None:
    """Write the merged model to `path` (a folder): safetensors shards of at most `shard_bytes` (one tensor over
    it goes alone), their index when there are several, the config and the generation config."""
    base, weights = peft_model.get_base_model(), merged_weights(peft_model, adapters)
    shards: list[list[str]] = [[]]
    held = 0
    for name, (_, size) in weights.items():
        if shards[-1] and held + size > shard_bytes:
            shards.append([])
            held = 0
        shards[-1].append(name)
        held += size
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for names, file in zip(shards, files, strict=True):
        save_file(
            {n: weights[n][0]().contiguous() for n in names}, str(path / file), metadata={"format": "pt"}
        )
    if len(shards) > 1:
        total = sum(size for _, size in weights.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: f for names, f in zip(shards, files, strict=True) for n in names}}  # fmt: skip
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    config.save_pretrained(path)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(path)
