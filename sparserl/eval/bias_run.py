"""The model side of `sparserl bias`: the policy as `sparserl train` builds it, the config's sampler and its dense
twin (coupled by their random streams), dense scoring, and each estimator's policy gradient at pi_theta = pi_old
(docs/bias.md). The gradients are flat float32 vectors; above `sketch_dim` parameters (full fine-tuning) they are
reduced by a CountSketch, which keeps inner products in expectation (tests/test_bias.py checks its cosines
against the exact ones)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sparserl.algo import (
    AlgoConfig,
    correction_reference,
    correction_weights,
    loss_denominator,
    policy_loss,
    ppo_anchor,
)
from sparserl.config import TrainConfig
from sparserl.eval.bias import DENSE, NAIVE, Coupled, advantages_of, padded

SKETCH_ABOVE = 8_000_000  # exact gradients up to this many trainable parameters (LoRA on small models)
SKETCH_DIM = 2**20  # else a CountSketch of this many buckets: cosine error ~ 1/sqrt(dim), 0.001


class BiasRun:
    """The policy (LoRA or full, as `sparserl train` loads it), the task's view, the sampler and its twin."""

    def __init__(self, cfg: TrainConfig, model_loader: Any = None, task: Any = None) -> None:
        from sparserl.engine import RolloutEngine
        from sparserl.rollout import TaskView
        from sparserl.tasks import make_task
        from sparserl.trainer.policy import Policy

        self.cfg = cfg
        torch.manual_seed(cfg.trainer.seed)
        self.policy = Policy(cfg.model, model_loader, seed=cfg.trainer.seed, distill=cfg.distill,
                             mmap_threshold=cfg.trainer.malloc_mmap_threshold)  # fmt: skip
        self.view = TaskView(
            task if task is not None else make_task(cfg.task, "train"), self.policy.tokenizer
        )
        dtype = self.policy.compute_dtype
        module, tok = self.policy.module, self.policy.tokenizer
        self.sampler = RolloutEngine(module, tok, cfg.kv if cfg.sparse else None, dtype)
        self.twin = RolloutEngine(module, tok, None, dtype)
        self.params = self.policy.trainable_parameters()
        self.size = sum(p.numel() for p in self.params)

    def sample(self, rows: list[int], seed: int) -> Coupled:
        """The rows' coupled samples: the config's sampler and the dense twin at the same seed and stream keys."""
        r, n = self.cfg.rollout, self.cfg.rollout.n
        prompts = [self.view.prompt_ids(row) for row in rows]
        keys = [row * n + j for row in rows for j in range(n)]
        kw = dict(n=n, max_new_tokens=r.max_new_tokens, top_p=r.top_p, top_k=r.top_k, stop=list(r.stop), seed=seed,
                  sample_keys=keys)  # fmt: skip
        # a block-sparse sampler records its top-k distributions for alpha (the acceptance rate, docs/calibration.md)
        record = {"top_logprobs": self.cfg.trainer.acceptance_top_k} if self.cfg.kv.sparse_attention else {}
        sparse = self.sampler.generate(prompts, temperature=r.sampling_temperature, **kw, **record)
        dense = self.twin.generate(prompts, temperature=r.temperature, **kw)
        sample_rows = [row for row in rows for _ in range(n)]
        sample_prompts = [self.view.prompt_ids(row) for row in sample_rows]
        examples = [self.view.example(row) for row in sample_rows]
        out = {}
        for name, got in (("sparse", sparse), (DENSE, dense)):
            tokens = [list(s.completion_ids) for s in got]
            reward = self.view.rewards(self.view.decode(tokens), examples).float()
            logp, mask = padded([s.logprobs.float() for s in got])
            old, _ = padded(self.score(sample_prompts, tokens), width=mask.shape[1])
            held = torch.tensor([s.stats.get("held_positions_mean", 0.0) for s in got], dtype=torch.float64)
            out[name] = (tokens, reward, logp, old, mask, held, float(got.stats["peak_kv_bytes"]))
        (st, sr, slp, so, sm, sh, sp), (dt, dr, dlp, do, dm, dh, dp) = out["sparse"], out[DENSE]
        alpha = self.alpha(sample_prompts, list(sparse)) if record else None
        return Coupled(
            sample_rows, sample_prompts, st, dt, sr, dr, slp, so, sm, dlp, do, dm, (sh, dh), (sp, dp), alpha
        )

    def alpha(self, prompts: list[list[int]], samples: list) -> tuple[Tensor, Tensor]:
        """alpha's top-k lower bound per generated token against the dense policy, and each token's sample."""
        from sparserl.engine.acceptance import rollout_acceptance

        r = self.cfg.rollout
        with torch.no_grad(), self.policy.autocast():
            a = rollout_acceptance(self.policy.module, prompts, samples, r.temperature, r.top_p, r.top_k)
        return a.topk, a.sequences

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[Tensor]:
        """Dense pi_old at rollout.temperature (no grad), as the trainer scores."""
        from sparserl.engine import score

        with torch.no_grad(), self.policy.autocast():
            return score(self.policy.module, prompts, completions, temperature=self.cfg.rollout.temperature)

    def gradients(
        self, c: Coupled, estimators: dict[str, AlgoConfig], micro: int, sketch: Sketch | None
    ) -> dict[str, Tensor]:
        """Each estimator's gradient on the sparse samples, and the naive one on the dense twins ('dense'),
        flat (or sketched), float32, divided by each loss's own denominator as the learner does."""
        n = self.cfg.rollout.n
        out = _batch_gradients(self, c.prompts, c.sparse, c.sparse_logp, c.sparse_old, c.sparse_mask,
                               advantages_of(c.sparse_reward, n, self.cfg.algo), estimators, micro)  # fmt: skip
        dense = _batch_gradients(self, c.prompts, c.dense, c.dense_logp, c.dense_old, c.dense_mask,
                                 advantages_of(c.dense_reward, n, self.cfg.algo), {DENSE: estimators[NAIVE]},
                                 micro)  # fmt: skip
        out.update(dense)
        return {k: (sketch(v) if sketch is not None else v) for k, v in out.items()}


def _batch_gradients(
    run: BiasRun,
    prompts: list[list[int]],
    completions: list[list[int]],
    logp_sampler: Tensor,
    logp_old: Tensor,
    mask: Tensor,
    adv: Tensor,
    estimators: dict[str, AlgoConfig],
    micro: int,
) -> dict[str, Tensor]:
    """One forward per micro-batch, one backward per estimator: corrections over the whole batch (the learner's
    corrections at one micro-batch per mini-batch), losses summed, then divided by each estimator's denominator."""
    from sparserl.engine import completion_logprobs

    plan = {}
    for name, algo in estimators.items():
        anchor = ppo_anchor(logp_old, logp_sampler, algo)
        reference = correction_reference(logp_old, logp_old, algo)  # the learner is pi_old here
        weights, keep, _ = correction_weights(reference, logp_sampler, mask, algo, adv)
        plan[name] = (algo, anchor, weights, keep, loss_denominator(mask & keep, algo, mask))
    sums = {name: [torch.zeros_like(p, dtype=torch.float32) for p in run.params] for name in estimators}
    for start in range(0, len(prompts), micro):
        rows = slice(start, start + micro)
        with run.policy.autocast():
            logp = completion_logprobs(run.policy.module, prompts[rows], completions[rows],
                                       temperature=run.cfg.rollout.temperature)[0].cpu()  # fmt: skip
        T = logp.shape[1]
        names = list(plan)
        for i, name in enumerate(names):
            algo, anchor, weights, keep, _ = plan[name]
            m = mask[rows, :T]
            loss, _ = policy_loss(
                logp, anchor[rows, :T], adv[rows], m & keep[rows, :T], weights[rows, :T], algo,
                response_mask=m, denominator=1.0, logp_sampler=logp_sampler[rows, :T],
            )  # fmt: skip
            grads = torch.autograd.grad(loss, run.params, retain_graph=i < len(names) - 1, allow_unused=True)
            for acc, g in zip(sums[name], grads, strict=True):
                if g is not None:
                    acc += g.float()
    return {name: torch.cat([g.reshape(-1) for g in sums[name]]) / max(plan[name][4], 1.0) for name in plan}


class Sketch:
    """CountSketch of flat vectors to `dim` buckets: coordinate i goes to bucket h(i) with sign s(i), both fixed
    by `seed`, so <S a, S b> is an unbiased estimate of <a, b> with variance about ||a||^2 ||b||^2 / dim. Kept in
    memory as int32 buckets and int8 signs (5 bytes per parameter): a [dim, P] random projection would not fit."""

    def __init__(self, size: int, dim: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dim = dim
        self.buckets = torch.randint(dim, (size,), generator=gen, dtype=torch.int64).to(torch.int32)
        self.signs = (torch.randint(2, (size,), generator=gen, dtype=torch.int8) * 2 - 1).to(torch.int8)

    def __call__(self, v: Tensor) -> Tensor:
        out = torch.zeros(self.dim, dtype=torch.float32)
        return out.index_add_(0, self.buckets.long(), v.float() * self.signs.float())


def make_sketch(size: int, dim: int | None, seed: int) -> Sketch | None:
    """A sketch when the gradient has more than `dim` entries (None: exact); `dim` None: the defaults above."""
    if dim is None:
        return Sketch(size, SKETCH_DIM, seed) if size > SKETCH_ABOVE else None
    return Sketch(size, dim, seed) if 0 < dim < size else None
