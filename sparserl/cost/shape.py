"""A model's shape as the cost model needs it, read from its Hugging Face config (no weights, no download)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparserl.config.errors import ConfigError
from sparserl.models import (
    EMBEDDED_DEFAULT,
    TINY_PREFIX,
    ModelLoadError,
    cache_dir,
    file_sha256,
    resolve_spec,
    tiny_model,
)

SIZES = ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "intermediate", "dtype_bytes")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CostInputError(ConfigError):
    """A cost-model input that cannot be used (the message names the flag or value): a usage error, exit 2
    like every command's."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder's FLOPs and bytes per token: a Llama-style model (gated MLP, GQA)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied_embeddings: bool
    dtype_bytes: int

    def __post_init__(self) -> None:
        for key in SIZES:
            if getattr(self, key) < 1:
                raise CostInputError(f"model {self.name}: {key}={getattr(self, key)} must be >= 1")
        if self.heads % self.kv_heads:
            raise CostInputError(
                f"model {self.name}: {self.heads} attention heads do not split into {self.kv_heads} KV heads"
            )

    @property
    def group(self) -> int:
        """Query heads per KV head (the spec's GQA ratio r)."""
        return self.heads // self.kv_heads

    @property
    def layer_params(self) -> int:
        """Weights one token multiplies in a layer: q, k, v, o projections and the gated MLP (gate, up, down)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden * q_out + 2 * self.hidden * kv_out + 3 * self.hidden * self.intermediate

    @property
    def token_params(self) -> int:
        """Weights every decoded token multiplies: all layers and the LM head (the embedding is a row lookup)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """Parameters of the model (norms and biases, < 0.1%, left out); tied embeddings share the LM head."""
        return self.token_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def kv_dim(self) -> int:
        """Key + value elements one position holds across all layers (the spec's D)."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def kv_bytes_per_position(self) -> int:
        """Bytes one held position costs across all layers, as the engine's `KVCache.bytes_per_position`."""
        return self.kv_dim * self.dtype_bytes


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name the engine runs in."""
    if name not in DTYPES:
        raise CostInputError(f"--dtype {name!r} is unknown; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def shape_from_config(config: Any, name: str, dtype: str = "float32") -> ModelShape:
    """The shape of a transformers config (a `PretrainedConfig` or anything with the same attributes)."""
    keys = {
        "layers": "num_hidden_layers",
        "hidden": "hidden_size",
        "heads": "num_attention_heads",
        "vocab": "vocab_size",
        "intermediate": "intermediate_size",
    }
    missing = [key for key in keys.values() if getattr(config, key, None) is None]
    if missing:
        raise ModelLoadError(f"model {name}: its config has no {', '.join(missing)}; is it a decoder LM?")
    sizes = {field: int(getattr(config, key)) for field, key in keys.items()}
    kv_heads = getattr(config, "num_key_value_heads", None) or sizes["heads"]
    head_dim = getattr(config, "head_dim", None) or sizes["hidden"] // sizes["heads"]
    return ModelShape(
        name=name,
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        dtype_bytes=torch_dtype(dtype).itemsize,
        **sizes,
    )


def load_shape(spec: str, dtype: str = "float32") -> ModelShape:
    """The shape of a model folder, a `.gguf` file, `smollm2-135m` or a Hugging Face id already in the local
    cache: only the config is read, and nothing is downloaded. `tiny-llama` / `tiny-qwen3` are the test models."""
    return shape_from_config(load_model_config(spec), spec, dtype)


def load_model_config(spec: str) -> Any:
    """The transformers config of a model spec (as `load_shape`: nothing downloaded, no weights read; the
    global RNG is left as it was); ModelLoadError when there is none."""
    from transformers import AutoConfig

    if spec.startswith(TINY_PREFIX):
        with torch.random.fork_rng(devices=[]):  # tiny_model seeds torch's generator
            return tiny_model(spec[len(TINY_PREFIX) :])[0].config
    source = resolve_spec(spec)
    try:
        if isinstance(source, Path) and source.is_file():  # resolve_spec lets only .gguf files through
            config = gguf_config(source)
        else:
            config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelLoadError(
            f"model '{spec}': no config found ({reason}); give a model folder with a config.json, a .gguf "
            f"file, '{EMBEDDED_DEFAULT}', or a Hugging Face id already downloaded (the cost model downloads "
            "nothing)"
        ) from err
    return config


def gguf_config(gguf: Path) -> Any:
    """A GGUF's config, from the model loader's cached copy when there is one (parsing the GGUF takes seconds)."""
    from transformers import AutoConfig

    root = cache_dir() / "gguf"
    entry = root / file_sha256(gguf, root / "hashes")
    if (entry / "config.json").is_file():
        return AutoConfig.from_pretrained(entry)
    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
