"""The trained policy: the model (optionally with PEFT LoRA adapters), its tokenizer, and the frozen reference
policy for the KL term (with LoRA: the same model with adapters disabled, so no second copy)."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sparserl.config import ConfigError, ModelConfig
from sparserl.models import ModelLoadError
from sparserl.trainer.checkpoint import atomic_dir

ModelLoader = Callable[[ModelConfig], tuple[Any, Any]]


def default_loader(cfg: ModelConfig) -> tuple[Any, Any]:
    """`sparserl.models.load_model(cfg.spec)` in the dtype its weights are kept in (`cfg.weights_dtype`)."""
    from sparserl.models import load_model

    return load_model(cfg.spec, dtype=getattr(torch, cfg.weights_dtype))


class Policy:
    """Model + tokenizer + reference. `module` is what the engine, scorer and learner run (the causal LM with
    LoRA layers injected in place, when LoRA is on)."""

    def __init__(
        self, cfg: ModelConfig, loader: ModelLoader | None = None, need_ref: bool = False, seed: int = 0
    ):
        from sparserl.models import prepare_for_training

        model, tokenizer = (loader or default_loader)(cfg)
        model.to(getattr(torch, cfg.weights_dtype))  # a custom loader's model too: master weights are float32
        prepare_for_training(model)  # a GGUF-loaded model carries a quantization marker that blocks training
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.peft = None
        self._ref: nn.Module | None = None
        if cfg.lora:
            from peft import LoraConfig, get_peft_model

            targets: list[str] | str = cfg.lora_targets
            if targets == ["all-linear"]:
                targets = "all-linear"
            torch.manual_seed(seed)  # LoRA's A matrices are randomly initialised
            lora = LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets
            )
            try:
                with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
                    warnings.filterwarnings(
                        "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
                    )
                    self.peft = get_peft_model(model, lora)
            except ValueError as e:
                raise ConfigError(
                    f"model.lora_targets={cfg.lora_targets} do not fit {cfg.spec!r}: {e}"
                ) from None
            self.module = self.peft.get_base_model()
        else:
            self.module = model
            if need_ref:
                self._ref = copy.deepcopy(model).eval().requires_grad_(False)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype rollouts, scoring and the update compute in (`model.dtype`)."""
        return getattr(torch, self.cfg.dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Scoring and the learner's forward: matmuls in the compute dtype when it is half precision (autocast
        casts the float32 master weights, or multiplies the LoRA base as it is), else plain float32."""
        device = self.module.get_input_embeddings().weight.device.type
        return torch.autocast(device, dtype=self.compute_dtype, enabled=self.cfg.dtype != "float32")

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimizer updates (adapters only with LoRA)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The reference (initial) policy: adapters disabled with LoRA, else the frozen copy."""
        if self.peft is not None:
            with self.peft.disable_adapter():
                yield self.module
        elif self._ref is not None:
            yield self._ref
        else:
            raise RuntimeError("no reference policy: it is built only when algo.kl_coef > 0")

    def weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores: the adapter weights with LoRA, else the full state dict."""
        if self.peft is not None:
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.peft, save_embedding_layers=False)
        return dict(self.module.state_dict())

    @property
    def weights_name(self) -> str:
        """File name of the checkpointed weights."""
        return "adapter.safetensors" if self.peft is not None else "model.safetensors"

    def load_weights(self, state: dict[str, torch.Tensor], source: str | Path = "checkpoint") -> None:
        """Inverse of `weights`, strict: missing, unexpected or differently shaped tensors are an error that
        names them and `source` (e.g. a resume whose model or LoRA settings differ from the run's)."""
        own = self.weights()
        tied = set(getattr(self.module, "_tied_weights_keys", None) or [])
        missing = [k for k in own if k not in state and k not in tied]
        unexpected = [k for k in state if k not in own]
        shapes = [
            f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
            for k in state
            if k in own and state[k].shape != own[k].shape
        ]
        if missing or unexpected or shapes:
            parts = [
                f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
                for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", shapes))
                if items
            ]
            raise ModelLoadError(
                f"{source}: the saved weights do not fit model {self.cfg.spec!r} (lora={self.cfg.lora}, "
                f"lora_r={self.cfg.lora_r}): {'; '.join(parts)}"
            )
        if self.peft is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.peft, state)
        else:
            self.module.load_state_dict(state, strict=False)

    def export(self, path: str | Path) -> Path:
        """Save a standalone Hugging Face model folder (LoRA merged into a copy) plus the tokenizer,
        atomically: it is written beside `path` and renamed into place, so a kill never leaves a half folder
        that `sparserl eval` cannot read (an existing one is replaced only once the new one is complete)."""
        path = Path(path)
        with atomic_dir(path) as tmp:
            self._save_pretrained(tmp)
        return path

    def _save_pretrained(self, path: Path) -> None:
        """Save a standalone Hugging Face model folder (LoRA merged into a copy) plus the tokenizer."""
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its bar would tear the live training bar
        try:
            if self.peft is not None:
                merged = copy.deepcopy(self.peft).merge_and_unload()
                merged.save_pretrained(path)
                del merged
            else:
                self.module.save_pretrained(path)
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()
        self.tokenizer.save_pretrained(path)
