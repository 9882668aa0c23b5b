"""DistillSparse v2's half of a step (Sparrow, spec section 6; for eviction methods too): on-policy distillation
of the dense policy into the sparse path, no reward term. After the policy's own update, with the base frozen and
the distill adapter on only for the student: the student (sparse attention + adapter, teacher-forced on the
step's own sparse samples by `engine.sparse_scoring`) is pulled towards the teacher, the dense policy as it is
after this step's update (re-scored, adapter off), by a full-vocabulary divergence per token, tail-weighted
(`algo.distill`). Alpha's tail (P5 per bin of absolute position) is measured on a fixed probe batch before and
after the update, teacher-forced, with the exact alpha. `DistillSparse` is the add-on learner the training loop
calls through the `AddOn` seam (trainer/addons.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor

from sparserl.algo.acceptance import acceptance_by_bin, acceptance_exact
from sparserl.algo.distill import distill_loss
from sparserl.config import ConfigError, TrainConfig
from sparserl.engine import score_distributions
from sparserl.engine.held import HeldRecord
from sparserl.engine.module_mode import module_mode
from sparserl.engine.padding import right_pad
from sparserl.engine.sampling import processed_logprobs
from sparserl.engine.sparse_scoring import sparse_completion_logits
from sparserl.engine.weights import bump_weights_version
from sparserl.trainer.addons import AddOn, register_addon
from sparserl.trainer.checkpoint import Checkpoint, Part
from sparserl.trainer.policy import Policy, grad_flags_kept
from sparserl.trainer.update import Batch, clipped_step, minibatch_updates


class DistillLearner:
    """The adapter's optimizer, its update per step and the probe of alpha's tail."""

    def __init__(self, cfg: TrainConfig, policy: Policy, autocast: Callable[[], AbstractContextManager]):
        self.cfg, self.policy, self.autocast = cfg, policy, autocast
        self.params = policy.distill_parameters()
        o = cfg.optim
        fused = all(p.device.type in ("cpu", "cuda") for p in self.params)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.distill.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
            fused=fused,
        )  # fmt: skip

    def part(self) -> Part:
        """What a checkpoint keeps of the adapter."""
        return Part(self.policy.adapter_weights(self.policy.distill_adapter), self.optimizer.state_dict())

    def load(self, part: Part) -> None:
        self.policy.load_adapter_weights(self.policy.distill_adapter, part.weights)
        self.optimizer.load_state_dict(part.optimizer)

    @contextmanager
    def _adapter_grads(self) -> Iterator[None]:
        """Gradients for the adapter alone (the base and the policy's LoRA frozen), the model in train mode."""
        module = self.policy.module
        mine = {id(p) for p in self.params}
        with grad_flags_kept(module):
            for p in module.parameters():
                p.requires_grad_(id(p) in mine)
            with module_mode(module, training=True):
                yield

    def _teacher(self, prompts: list[list[int]], completions: list[list[int]]) -> Tensor:
        """The dense policy's processed next-token log-probs [B, T, V] at every completion position (adapter
        off, no grad; padding rows 0), as it is now: after this step's policy update."""
        r = self.cfg.rollout
        with torch.no_grad(), self.autocast():
            dense = score_distributions(
                self.policy.module, prompts, completions, r.temperature, r.top_p, r.top_k, 1, True
            )
        width = max(len(c) for c in completions)
        out = torch.zeros(len(prompts), width, dense[0].full_logprobs.shape[-1])
        for i, d in enumerate(dense):
            out[i, : d.full_logprobs.shape[0]] = d.full_logprobs
        return out

    def _student(self, prompts, completions, held) -> Tensor:
        """The sparse path's processed log-probs [B, T, V] (adapter on, differentiable), on the CPU."""
        r = self.cfg.rollout
        with self.policy.sparse_path(), self.autocast():
            logits, _, _ = sparse_completion_logits(
                self.policy.module, self.cfg.kv, prompts, completions, held
            )
        return processed_logprobs(logits.float(), r.temperature, r.top_p, r.top_k).cpu()

    def update(self, batch: Batch, policy_lr: float) -> dict[str, float]:
        """One pass of the adapter over the step's mini-batches (the policy's sizes), one AdamW step each at
        distill.lr (its own, not the policy's: `policy_lr` is not used). The loss per mini-batch is the
        tail-weighted divergence summed over its tokens, divided by their count."""
        cfg, d = self.cfg, self.cfg.distill
        n = len(batch.prompts)
        mini = cfg.optim.mini_batch_size or n

        def micro_step(micro: Tensor, finite: bool) -> tuple[Tensor, dict[str, float], float]:
            idx = micro.tolist()
            prompts, completions = [batch.prompts[i] for i in idx], [batch.completions[i] for i in idx]
            held = [batch.held[i] for i in idx] if batch.held is not None else None
            teacher = self._teacher(prompts, completions)
            student = self._student(prompts, completions, held)
            mask = right_pad(completions, width=teacher.shape[1])[1]
            positions = torch.tensor([len(p) for p in prompts])[:, None] + torch.arange(teacher.shape[1])
            loss, metrics = distill_loss(
                student, teacher, positions, mask, d.divergence, d.tail_weight, d.tail_fraction,
                cfg.trainer.acceptance_bin,
            )  # fmt: skip
            return loss, metrics, float(mask.sum())

        with self._adapter_grads():
            minibatches = (torch.arange(start, min(start + mini, n)) for start in range(0, n, mini))
            sums, steps, skipped = minibatch_updates(
                minibatches, cfg.optim.grad_accum, self.optimizer, micro_step, self._step
            )
        out = {k: v / max(steps, 1) for k, v in sums.items()}
        out["distill/lr"] = self.optimizer.param_groups[0]["lr"]
        out["distill/skipped_updates"] = float(skipped)
        return out

    def _step(self, denominator: float, sums: dict[str, float]) -> bool:
        """The policy's `clipped_step` (optim.grad_clip); False (skipped) when the gradient is not finite."""
        norm = clipped_step(self.params, self.optimizer, denominator, self.cfg.optim.grad_clip)
        if norm is None:
            return False
        bump_weights_version(self.policy.module)  # the sparse path's weights moved: its engines repack
        sums["distill/grad_norm"] = sums.get("distill/grad_norm", 0.0) + norm
        return True

    @torch.no_grad()
    def probe_alpha(self, probe: dict[str, Any], when: str) -> dict[str, float]:
        """Exact alpha between the sparse path (adapter on, sparse replay) and the dense policy on the
        probe's fixed samples, pooled per bin of absolute position (trainer.acceptance_bin): its P5 and mean,
        as `distill/alpha_<stat>_<when>/bin<i>`."""
        cfg, r = self.cfg, self.cfg.rollout
        prompts, completions = probe["prompts"], probe["completions"]
        held = [HeldRecord.from_dict(h) for h in probe["held"]] if probe.get("held") else None
        with self.autocast():
            dense = score_distributions(
                self.policy.module, prompts, completions, r.temperature, r.top_p, r.top_k, 1, True
            )
            with self.policy.sparse_path():
                logits, _, mask = sparse_completion_logits(
                    self.policy.module, cfg.kv, prompts, completions, held
                )
        alpha, positions = [], []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            sparse = processed_logprobs(logits[i, : len(c)].float(), r.temperature, r.top_p, r.top_k)
            alpha.append(acceptance_exact(sparse.cpu(), dense[i].full_logprobs))
            positions.append(len(p) + torch.arange(len(c)))
        bins = acceptance_by_bin(
            torch.cat(alpha), torch.cat(positions), cfg.trainer.acceptance_bin, cfg.trainer.acceptance_tau
        )
        out: dict[str, float] = {}
        for b in bins:
            if b.p5 is not None:
                out[f"distill/alpha_p5_{when}/bin{b.index}"] = b.p5
                out[f"distill/alpha_mean_{when}/bin{b.index}"] = b.mean
        return out


DISTILL_PART = "distill"  # the add-on's name: the checkpoint sub-folder holding the adapter and its optimizer


@register_addon(DISTILL_PART)
class DistillSparse(AddOn):
    """DistillSparse in the loop: the adapter's update after the policy's, with alpha's tail on a fixed probe
    (drawn from the first step's batch) before and after every `distill.probe_every` steps."""

    records_held = True  # an evicting sampler's replay

    def __init__(self, cfg: TrainConfig, policy: Policy) -> None:
        super().__init__(cfg, policy)
        self.learner = DistillLearner(cfg, policy, policy.autocast)
        self.probe: dict[str, Any] | None = None

    @classmethod
    def enabled(cls, cfg: TrainConfig) -> bool:
        return cfg.distill.enable

    def update(self, step: int, batch: Batch, policy_lr: float) -> dict[str, float]:
        d, t0 = self.cfg.distill, time.perf_counter()
        if d.probe_samples and self.probe is None:
            self.probe = probe_batch(batch, d.probe_samples)
        probe = self.probe if step % d.probe_every == 0 else None
        out = self.learner.probe_alpha(probe, "before") if probe else {}
        out.update(self.learner.update(batch, policy_lr))
        if probe:
            out.update(self.learner.probe_alpha(probe, "after"))
        out["time/distill"] = time.perf_counter() - t0
        return out

    def part(self) -> Part:
        part = self.learner.part()
        part.state = {"probe": self.probe} if self.probe is not None else {}
        return part

    def resume(self, ckpt: Checkpoint) -> None:
        """The adapter, its optimizer and probe from the checkpoint; one saved without them is refused unless
        distill.fresh_on_resume asks for a new adapter."""
        part = ckpt.parts.get(self.name)
        if part is not None:
            self.learner.load(part)
            self.probe = part.state.get("probe")
        elif self.cfg.distill.fresh_on_resume:
            self.notes.append(f"{ckpt.path.name} has no DistillSparse adapter: a fresh one starts now")
        else:
            raise ConfigError(
                f"--resume: {ckpt.path} was saved without the DistillSparse adapter (distill was off), so "
                "distill.enable=true has nothing to continue; add distill.fresh_on_resume=true to start a fresh "
                "adapter from here"
            )


def probe_batch(batch: Batch, size: int) -> dict[str, Any]:
    """The fixed probe: `size` samples spread evenly over the first step's batch (several prompts)."""
    stride = max(1, len(batch.prompts) // max(size, 1))
    picked = list(range(0, len(batch.prompts), stride))[:size]
    return {
        "prompts": [list(batch.prompts[i]) for i in picked],
        "completions": [list(batch.completions[i]) for i in picked],
        "held": [batch.held[i].to_dict() for i in picked] if batch.held is not None else None,
    }
