"""DistillSparse's half of a step (Sparrow, spec section 6; for eviction methods too). After the policy's own update, with the base frozen
and the distill adapter on: PPO on the sparse-forward log-probs of the step's samples, anchored at the
sampler's recorded log-probs (the samples are the sparse path's own), with the rollout's advantages, plus
distill.kl_coef x k3-KL(sparse path || dense policy) on the sampled tokens. The loss is `algo.policy_loss` with
those settings; the sparse forward is `engine.sparse_scoring`. Alpha's tail (P5 per bin of absolute position)
is measured on a fixed probe batch before and after the update, teacher-forced, with the exact alpha.
`DistillSparse` is the add-on learner the training loop calls through the `AddOn` seam (trainer/addons.py)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor

from sparserl.algo import loss_denominator, policy_loss
from sparserl.algo.acceptance import acceptance_by_bin, acceptance_exact
from sparserl.config import ConfigError, TrainConfig
from sparserl.engine import score_distributions
from sparserl.engine.held import HeldRecord
from sparserl.engine.module_mode import module_mode
from sparserl.engine.sampling import processed_logprobs
from sparserl.engine.sparse_scoring import sparse_completion_logits, sparse_completion_logprobs
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
            self.params, lr=o.lr * cfg.distill.lr_scale, betas=tuple(o.betas), eps=o.eps,
            weight_decay=o.weight_decay, fused=fused,
        )  # fmt: skip
        # the policy's clip and aggregation; the KL term is the adapter's own, to the dense policy
        self.algo = dataclasses.replace(
            cfg.algo, kl_coef=cfg.distill.kl_coef, kl_estimator="k3", entropy_coef=0.0
        )

    def part(self) -> Part:
        """What a checkpoint keeps of the adapter."""
        return Part(self.policy.adapter_weights(self.policy.distill_adapter), self.optimizer.state_dict())

    def load(self, part: Part) -> None:
        self.policy.load_adapter_weights(self.policy.distill_adapter, part.weights)
        self.optimizer.load_state_dict(part.optimizer)

    @contextmanager
    def _adapter_only(self) -> Iterator[None]:
        """Gradients for the adapter alone (the base and the policy's LoRA frozen), the model in train mode."""
        module = self.policy.module
        mine = {id(p) for p in self.params}
        with grad_flags_kept(module):
            for p in module.parameters():
                p.requires_grad_(id(p) in mine)
            with module_mode(module, training=True), self.policy.sparse_path():
                yield

    def update(self, batch: Batch, policy_lr: float) -> dict[str, float]:
        """One pass of the adapter over the step's mini-batches (the policy's sizes), one AdamW step each, at
        distill.lr_scale x the policy's current lr. `batch.logp_old` holds the dense log-probs."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = policy_lr * cfg.distill.lr_scale
        n = len(batch.prompts)
        mini = cfg.optim.mini_batch_size or n

        def micro_step(micro: Tensor, finite: bool) -> tuple[Tensor, dict[str, float], float]:
            idx = micro.tolist()
            held = [batch.held[i] for i in idx] if batch.held is not None else None
            with self.autocast():
                logp, _ = sparse_completion_logprobs(
                    self.policy.module, cfg.kv, [batch.prompts[i] for i in idx],
                    [batch.completions[i] for i in idx], cfg.rollout.temperature, held,
                )  # fmt: skip
            logp = logp.cpu()  # the loss math runs on the batch's CPU tensors, as in the update
            t = logp.shape[1]
            mask = batch.mask[micro, :t]
            loss, m = policy_loss(
                logp, batch.logp_sampler[micro, :t], batch.advantages_of(micro, t), mask, None, self.algo,
                logp_ref=batch.logp_old[micro, :t], response_mask=mask, denominator=1.0,
            )  # fmt: skip
            return loss, m, loss_denominator(mask, self.algo, mask)

        with self._adapter_only():
            minibatches = (torch.arange(start, min(start + mini, n)) for start in range(0, n, mini))
            sums, steps, skipped = minibatch_updates(
                minibatches, cfg.optim.grad_accum, self.optimizer, micro_step, self._step
            )
        out = {_name(k): v / max(steps, 1) for k, v in sums.items()}
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

    needs_dense_logprobs = True  # the KL term is to the dense policy, scored before the update
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


def _name(key: str) -> str:
    """actor/<name> of `policy_loss` -> distill/<name>; its KL to the reference is the KL to the dense policy."""
    name = key.split("/", 1)[1]
    return "distill/kl" if name == "kl_ref" else f"distill/{name}"
