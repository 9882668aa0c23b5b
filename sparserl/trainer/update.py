"""The learner's half of a step: corrections, then K passes of AdamW over shuffled mini-batches with gradient
accumulation, clipping and the lr schedule. A mini-batch with a NaN/inf anywhere is skipped and counted;
weights that turn non-finite stop the run before anything is saved."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sparserl.algo import (
    correction_reference,
    correction_weights,
    loss_denominator,
    policy_loss,
    ppo_anchor,
)
from sparserl.config import TrainConfig
from sparserl.errors import UserError
from sparserl.trainer.data import derive_seed

SHUFFLE = 2  # seed purpose of the mini-batch order (see loop.py for the others)
# Loss metrics that add up over micro-batches (then divide by the mini-batch's denominator); the others are
# per-micro-batch statistics, averaged weighted by size.
SUMMED = ("actor/loss", "actor/pg_loss", "actor/kl_ref", "actor/entropy")


class WeightsDiverged(UserError):
    """An optimizer step made the weights NaN/inf; the run stops without saving them (the settings, such as
    the learning rate, are the usual culprit, so the CLI reports it in one line)."""


@dataclass
class Batch:
    """One step's rollouts, padded to [B, T] (right padding) for the learner."""

    prompts: list[list[int]]
    completions: list[list[int]]
    mask: Tensor  # [B, T] bool response mask
    logp_sampler: Tensor  # [B, T]
    logp_old: Tensor | None  # [B, T] dense old policy (None: bypass mode, or taken from the learner's pass)
    logp_ref: Tensor | None  # [B, T] reference policy (None when kl_coef == 0)
    advantages: Tensor  # [B]
    held: list | None = None  # per sample, what an evicting sampler held (engine.held), for its replay


def pad(rows: Sequence[Tensor | Sequence[float]], length: int | None = None) -> tuple[Tensor, Tensor]:
    """Right-pad 1-D rows into [B, T] float32 values and a bool mask."""
    length = max((len(r) for r in rows), default=0) if length is None else length
    out = torch.zeros(len(rows), length, dtype=torch.float32)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r)
        if n:
            out[i, :n] = torch.as_tensor(r, dtype=torch.float32)[:length]
            mask[i, :n] = True
    return out, mask


def _unusable(mask: Tensor, *logps: Tensor) -> bool:
    """True if any of `logps` is NaN or +inf on `mask` (-inf in pi_old is legal: the veto catches it)."""
    return any(bool((mask & (torch.isnan(x) | (x == float("inf")))).any()) for x in logps)


def clipped_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, denominator: float, grad_clip: float
) -> float | None:
    """Scale the accumulated gradient by 1/denominator, clip its norm to `grad_clip` (0: no clipping) and take
    an optimizer step if it is finite; returns the norm before clipping, or None (step skipped)."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(denominator)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if not torch.isfinite(norm):
        return None
    optimizer.step()
    return float(norm)


class Learner:
    """Owns the optimizer and the lr schedule of the policy's trainable parameters."""

    def __init__(
        self,
        cfg: TrainConfig,
        module: torch.nn.Module,
        params: list[torch.nn.Parameter],
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ) -> None:
        """`autocast()` wraps each micro-batch's forward (half-precision matmuls over float32 master weights)."""
        from transformers import get_scheduler

        if not params:
            raise ValueError(f"model {cfg.model.spec!r} has no trainable parameters")
        self.cfg, self.module, self.params, self.autocast = cfg, module, params, autocast
        o = cfg.optim
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]  # norms and biases are not decayed
        groups = [{"params": decay, "weight_decay": o.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        # fused: one kernel over all tensors instead of a Python loop per tensor (SmolLM2, full fine-tuning, one
        # CPU thread: 0.20 s per step against 0.91 s); torch has it for CPU and CUDA tensors
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)
        name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[o.schedule]
        total = max(1, cfg.trainer.steps * self.steps_per_rollout)
        self.scheduler = get_scheduler(
            name, self.optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total
        )

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps taken per training step: K epochs x mini-batches per rollout batch."""
        mini = self.cfg.optim.mini_batch_size or self.cfg.rollout_batch
        return self.cfg.optim.ppo_epochs * (self.cfg.rollout_batch // mini)

    def single_update(self) -> bool:
        """True when pi_old can come from the learner's pass: one update per rollout batch, decoupled (or
        none) mode, and no dropout (train mode == eval mode), so the weights have not moved yet."""
        module = self.module
        dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())
        dropout = dropout or bool(getattr(getattr(module, "config", None), "attention_dropout", 0.0))
        return self.steps_per_rollout == 1 and self.cfg.algo.needs_recompute and not dropout

    def update(self, step: int, batch: Batch) -> dict[str, float]:
        """K passes over shuffled mini-batches; returns the step's loss, optimizer and correction metrics.

        The PPO ratio is taken against `ppo_anchor` (dense pi_old; the sampler's in bypass mode). When
        `batch.logp_old` is None outside bypass mode, pi_old is the learner's own first forward (exact: one
        update per rollout). Corrections are computed per micro-batch (the TIS batch normalisation is over the
        micro-batch's valid tokens, as in the reference code) against `correction_reference`. Each micro-batch
        loss is a sum (denominator 1); the gradients are divided by the mini-batch's denominator before
        clipping, so rejection decided inside the pass still sets the denominator exactly.
        """
        from sparserl.engine import completion_logprobs

        cfg, algo = self.cfg, self.cfg.algo
        self.module.train()
        B = len(batch.prompts)
        mini = cfg.optim.mini_batch_size or B
        from_learner = batch.logp_old is None and algo.needs_recompute
        anchor = (
            batch.logp_sampler.clone()
            if from_learner
            else ppo_anchor(batch.logp_old, batch.logp_sampler, algo)
        )
        # what the step's correction metrics compare with the sampler: pi_old, or the learner at its first pass
        reference = anchor.clone()
        seen = torch.zeros(B, dtype=torch.bool)
        sums: dict[str, float] = {}
        skipped = 0
        for epoch in range(cfg.optim.ppo_epochs):
            gen = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step, epoch, SHUFFLE))
            order = torch.randperm(B, generator=gen)
            for start in range(0, B, mini):
                mb = order[start : start + mini]
                self.optimizer.zero_grad(set_to_none=True)
                finite, denominator, parts = True, 0.0, {}
                for micro in torch.tensor_split(mb, cfg.optim.grad_accum):
                    if len(micro) == 0:
                        continue
                    idx = micro.tolist()
                    with self.autocast():
                        out = completion_logprobs(
                            self.module,
                            [batch.prompts[i] for i in idx],
                            [batch.completions[i] for i in idx],
                            temperature=cfg.rollout.temperature,
                            with_entropy=algo.entropy_coef > 0,
                        )
                    # the loss math runs on the batch's CPU tensors; autograd takes the gradient back to the
                    # model's device
                    logp, entropy = out[0].cpu(), (out[2].cpu() if len(out) > 2 else None)
                    T = logp.shape[1]
                    mask = batch.mask[micro, :T]
                    if from_learner:
                        anchor[micro, :T] = logp.detach()
                    old = anchor[micro, :T]
                    ref = correction_reference(old, logp, algo)
                    first = ~seen[micro]
                    reference[micro[first], :T] = ref[first]
                    seen[micro] = True
                    if not finite or _unusable(mask, logp.detach(), old, ref):
                        finite = False  # keep going without backward: pi_old of later micro-batches is needed
                        continue
                    weights, keep, _ = correction_weights(
                        ref, batch.logp_sampler[micro, :T], mask, algo, batch.advantages[micro]
                    )
                    denominator += loss_denominator(mask & keep, algo, mask)
                    loss, m = policy_loss(
                        logp,
                        old,
                        batch.advantages[micro],
                        mask & keep,
                        weights,
                        algo,
                        logp_ref=batch.logp_ref[micro, :T] if batch.logp_ref is not None else None,
                        entropy=entropy,
                        response_mask=mask,
                        denominator=1.0,
                    )
                    if not torch.isfinite(loss):
                        finite = False
                        continue
                    loss.backward()
                    for k, v in m.items():
                        parts[k] = parts.get(k, 0.0) + (v if k in SUMMED else v * len(idx) / len(mb))
                if finite and self._step(max(denominator, 1.0), sums):
                    for k, v in parts.items():
                        sums[k] = sums.get(k, 0.0) + (v / max(denominator, 1.0) if k in SUMMED else v)
                else:
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                with warnings.catch_warnings():  # the schedule advances even when an update was skipped
                    warnings.filterwarnings(
                        "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
                    )
                    self.scheduler.step()
        self.module.eval()
        return self._metrics(sums, skipped, reference, batch)

    def _step(self, denominator: float, sums: dict[str, float]) -> bool:
        """`clipped_step`, then: raises WeightsDiverged if the step made any weight non-finite."""
        norm = clipped_step(self.params, self.optimizer, denominator, self.cfg.optim.grad_clip)
        if norm is None:
            return False
        sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + norm
        # one fused pass: a NaN/inf weight makes the norm of all weights NaN/inf (and finite weights cannot
        # overflow it: that would take weights near 1e19). 0.07 s for SmolLM2 at one thread, against 0.83 s
        # for a finiteness check per tensor
        if not torch.isfinite(torch.nn.utils.get_total_norm(self.params)):
            raise WeightsDiverged(
                f"an optimizer step made the weights NaN/inf (optim.lr={self.cfg.optim.lr}); the run stops "
                "here and nothing from this step is saved: resume from the last checkpoint with a lower "
                "optim.lr or a tighter optim.grad_clip"
            )
        return True

    def _metrics(
        self, sums: dict[str, float], skipped: int, reference: Tensor, batch: Batch
    ) -> dict[str, Any]:
        """Averages over the updates taken, skip count, lr, and the whole batch's correction metrics (rows
        whose log-probs are NaN/inf are left out of the latter)."""
        taken = self.steps_per_rollout - skipped
        out = {k: v / max(taken, 1) for k, v in sums.items()}
        out["train/nonfinite_skipped_updates"] = float(skipped)
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        bad = torch.isnan(reference) | (reference == float("inf")) | ~torch.isfinite(batch.logp_sampler)
        usable = batch.mask & ~(batch.mask & bad).any(dim=1, keepdim=True)
        _, _, corr = correction_weights(
            reference, batch.logp_sampler, usable, self.cfg.algo, batch.advantages
        )
        out.update(corr)
        out["rejection_rate"] = corr.get("rollout_corr/seq_rejection_rate", 0.0)
        return out
