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
from sparserl.config.distill import DistillConfig
from sparserl.engine.rollout import register_sparse_path
from sparserl.engine.weights import bump_weights_version, keep_head_float32, track_weights_version
from sparserl.models import ModelLoadError
from sparserl.trainer.checkpoint import atomic_dir
from sparserl.trainer.export import save_merged

ModelLoader = Callable[[ModelConfig], tuple[Any, Any]]
_ADAPTER_KEY = "lora_"  # PEFT's LoRA parameters carry it in their names


def _base_key(key: str) -> str:
    """A weight's name in the plain model, from its name inside a PEFT LoRA layer (PEFT keeps the wrapped
    Linear as `base_layer` and has no public inverse for a model it did not merge)."""
    return key.replace(".base_layer.", ".")


def _lora_config(r: int, alpha: float, dropout: float, targets: list[str]) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets)  # fmt: skip


def _wrap(model: nn.Module, lora: Any, name: str, culprit: str) -> Any:
    """`get_peft_model` with adapter `name`; a target list that does not fit the model is a ConfigError."""
    from peft import get_peft_model

    try:
        with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(model, lora, adapter_name=name)
    except ValueError as e:
        raise ConfigError(f"{culprit}: {e}") from None


@contextlib.contextmanager
def grad_flags_kept(module: nn.Module) -> Iterator[None]:
    """Every parameter's requires_grad put back as it was on exit (PEFT's adapter switches change them)."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def default_loader(cfg: ModelConfig) -> tuple[Any, Any]:
    """`sparserl.models.load_model(cfg.spec)` in the dtype its weights are kept in (`cfg.weights_dtype`)."""
    from sparserl.models import load_model

    return load_model(cfg.spec, dtype=getattr(torch, cfg.weights_dtype))


def autocast_for(module: nn.Module, dtype: str) -> contextlib.AbstractContextManager:
    """Matmuls in `dtype` when it is half precision (autocast casts the float32 master weights, or multiplies
    the LoRA base as it is), else plain float32, on the module's device (a learner rank's copy runs it too)."""
    device = module.get_input_embeddings().weight.device.type
    return torch.autocast(device, dtype=getattr(torch, dtype), enabled=dtype != "float32")


class Policy:
    """Model + tokenizer + reference. `module` is what the engine, scorer and learner run (the causal LM with
    LoRA layers injected in place, when LoRA is on)."""

    def __init__(
        self,
        cfg: ModelConfig,
        loader: ModelLoader | None = None,
        need_ref: bool = False,
        seed: int = 0,
        distill: DistillConfig | None = None,
        mmap_threshold: int = 0,
    ):
        from sparserl.device import resolve_device
        from sparserl.models import prepare_for_training, return_freed_memory

        device = resolve_device(cfg.device, "model.device")  # before the load: a bad device fails at once
        # trainer.malloc_mmap_threshold: a training step's freed activations go back to the system (0: glibc's own)
        return_freed_memory(mmap_threshold)
        model, tokenizer = (loader or default_loader)(cfg)
        # a custom loader's model too: master weights are float32; LoRA layers follow their base onto the device
        model.to(dtype=getattr(torch, cfg.weights_dtype), device=device)
        prepare_for_training(model)  # a GGUF-loaded model carries a quantization marker that blocks training
        if cfg.fp32_lm_head:  # before the reference is copied: it scores with the same head
            try:
                keep_head_float32(model.get_output_embeddings())
            except ValueError as e:
                raise ConfigError(f"{e} ({cfg.spec!r})") from None
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.peft = None
        self._replica_pefts: dict[int, Any] = {}  # a sampler replica's PEFT wrapper, by id of the replica
        self._ref: nn.Module | None = None
        self.own_adapters: list[str] = []  # the policy's own adapters: on everywhere
        self.distill_adapter: str | None = None  # on only on the sparse path (DistillSparse)
        if cfg.lora:
            torch.manual_seed(seed)  # LoRA's A matrices are randomly initialised
            self.peft = _wrap(model, _lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets),
                              "default", f"model.lora_targets={cfg.lora_targets} do not fit {cfg.spec!r}")  # fmt: skip
            self.own_adapters = ["default"]
            self.module = self.peft.get_base_model()
        else:
            self.module = model
            if need_ref:
                self._ref = copy.deepcopy(model).eval().requires_grad_(False)
        if distill is not None and distill.enable:
            self._add_distill_adapter(distill, seed)
        # the learners bump it after every optimizer step (and `load_weights` here): engines over the module keep
        # their packed weights between calls at one version (engine/weights.py)
        track_weights_version(self.module)

    def _add_distill_adapter(self, d: DistillConfig, seed: int) -> None:
        """The DistillSparse adapter, beside the policy's own LoRA or injected into the full model (whose
        weights stay trainable), switched off until `sparse_path()` turns it on."""
        lora = _lora_config(d.lora_r, d.lora_alpha, 0.0, d.lora_targets)
        culprit = f"distill.lora_targets={d.lora_targets} do not fit {self.cfg.spec!r}"
        torch.manual_seed(seed + 1)  # its own A matrices, not a copy of the policy's
        if self.peft is not None:
            if d.adapter_name in self.peft.peft_config:
                raise ConfigError(
                    f"distill.adapter_name={d.adapter_name!r} is the policy's own adapter's name"
                )
            try:
                self.peft.add_adapter(d.adapter_name, lora)
            except ValueError as e:
                raise ConfigError(f"{culprit}: {e}") from None
        else:
            self.peft = _wrap(self.module, lora, d.adapter_name, culprit)
            self.module = self.peft.get_base_model()
            for name, p in self.module.named_parameters():
                p.requires_grad_(_ADAPTER_KEY not in name)  # PEFT froze the base: the policy trains it
        self.distill_adapter = d.adapter_name
        self._activate(self.own_adapters)
        register_sparse_path(self.module, self.sparse_path)  # every sparse engine over it samples with it

    def _activate(self, names: list[str], peft: Any = None) -> None:
        """Make exactly `names` the active adapters (of `peft`, by default the policy's own), leaving every
        parameter's requires_grad as it was (PEFT's switches also (un)freeze adapters, which is the optimizers'
        business here, not the switch's)."""
        peft = peft or self.peft
        base = peft.base_model
        with grad_flags_kept(peft.get_base_model()):
            if names:
                base.enable_adapter_layers()
                base.set_adapter(names)
            else:
                base.disable_adapter_layers()

    @contextlib.contextmanager
    def sparse_path(self, peft: Any = None) -> Iterator[None]:
        """The distill adapter on, beside the policy's own, for sparse sampling and its replay (a no-op
        without DistillSparse); `peft`: a replica's adapters instead of the policy's."""
        if self.distill_adapter is None:
            yield
            return
        self._activate([*self.own_adapters, self.distill_adapter], peft)
        try:
            yield
        finally:
            self._activate(self.own_adapters, peft)

    def sampler_replica(self) -> nn.Module:
        """A second module for a sampler that runs while the learner updates (rollout.overlap): the trainable
        tensors copied, every frozen one shared with the policy (with LoRA only the adapters are copied), with
        adapter switches of its own for DistillSparse's sparse path. Refreshed by `load_named` once per version."""
        frozen = {id(p): p for p in self.module.parameters() if not p.requires_grad}
        if self.peft is None:
            return copy.deepcopy(self.module, memo=frozen)
        peft = copy.deepcopy(self.peft, memo=frozen)
        replica = peft.get_base_model()
        self._replica_pefts[id(replica)] = peft
        if self.distill_adapter is not None:
            register_sparse_path(replica, lambda: self.sparse_path(peft))
        return replica

    def distill_parameters(self) -> list[nn.Parameter]:
        """The distill adapter's parameters (the DistillSparse optimizer's)."""
        tag = f".{self.distill_adapter}."
        return [p for n, p in self.module.named_parameters() if self.distill_adapter and tag in n]

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype rollouts, scoring and the update compute in (`model.dtype`)."""
        return getattr(torch, self.cfg.dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Scoring and the learner's forward in `model.dtype` (`autocast_for`)."""
        return autocast_for(self.module, self.cfg.dtype)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the policy's optimizer updates (adapters only with LoRA; never the distill adapter)."""
        distill = {id(p) for p in self.distill_parameters()}
        return [p for p in self.module.parameters() if p.requires_grad and id(p) not in distill]

    @contextlib.contextmanager
    def reference(self, replica: nn.Module | None = None) -> Iterator[nn.Module]:
        """The reference (initial) policy: adapters disabled with LoRA (those of `replica`, a `sampler_replica`,
        when given: its thread scores without touching the learner's switches), else the frozen copy."""
        if self.cfg.lora:
            peft = self._replica_pefts[id(replica)] if replica is not None else self.peft
            self._activate([], peft)
            try:
                yield replica if replica is not None else self.module
            finally:
                self._activate(self.own_adapters, peft)
        elif self._ref is not None:
            yield self._ref
        else:
            raise RuntimeError("no reference policy: it is built only when algo.kl_coef > 0")

    def weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores: the adapter weights with LoRA, else the full state dict (without the
        distill adapter, under the model's own names)."""
        if self.cfg.lora:
            return self.adapter_weights("default")
        return {_base_key(k): v for k, v in self.module.state_dict().items() if _ADAPTER_KEY not in k}

    def adapter_weights(self, name: str) -> dict[str, torch.Tensor]:
        """One PEFT adapter's weights, under PEFT's adapter-free keys."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft, adapter_name=name, save_embedding_layers=False)

    @property
    def weights_name(self) -> str:
        """File name of the checkpointed weights."""
        return "adapter.safetensors" if self.cfg.lora else "model.safetensors"

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
        if self.cfg.lora:
            self.load_adapter_weights("default", state)
        elif self.distill_adapter is not None:  # the model's own names -> the names inside the LoRA layers
            names = {_base_key(k): k for k in self.module.state_dict() if _ADAPTER_KEY not in k}
            self.module.load_state_dict({names[k]: v for k, v in state.items()}, strict=False)
        else:
            self.module.load_state_dict(state, strict=False)
        bump_weights_version(self.module)

    def load_adapter_weights(self, name: str, state: dict[str, torch.Tensor]) -> None:
        """Inverse of `adapter_weights`."""
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.peft, state, adapter_name=name)
        bump_weights_version(self.module)

    def export(self, path: str | Path) -> Path:
        """Save a standalone Hugging Face model folder (LoRA merged) plus the tokenizer,
        atomically: it is written beside `path` and renamed into place, so a kill never leaves a half folder
        that `sparserl eval` cannot read (an existing one is replaced only once the new one is complete)."""
        path = Path(path)
        with atomic_dir(path) as tmp:
            self._save_pretrained(tmp)
        return path

    def _save_pretrained(self, path: Path) -> None:
        """Save a standalone Hugging Face model folder (LoRA merged shard by shard: trainer/export.py) plus the
        tokenizer."""
        from transformers.utils import logging as hf_logging

        was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its bar would tear the live training bar
        try:
            if self.peft is not None:  # the dense policy: its own adapters merged, the distill one left out
                save_merged(self.peft, self.own_adapters, path)
            else:
                self.module.save_pretrained(path)
        finally:
            if was_enabled:
                hf_logging.enable_progress_bar()
        self.tokenizer.save_pretrained(path)
