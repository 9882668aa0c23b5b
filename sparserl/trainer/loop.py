"""The training loop: sample prompts, roll out (sparse or dense), reward, advantages, dense old/reference
log-probs, corrections, K passes of AdamW over mini-batches, metrics, checkpoint. The next rollout sees the new
weights because the engine runs the very modules being trained."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sparserl.algo import (
    advantages_from_config,
    correction_weights,
    loss_denominator,
    policy_loss,
    ppo_anchor,
)
from sparserl.config import TrainConfig, load_config, save_config
from sparserl.trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from sparserl.trainer.data import PromptSampler, derive_seed
from sparserl.trainer.logging import METRICS_FILE, TB_DIR, MetricSinks, ProgressDisplay, check_backends
from sparserl.trainer.policy import ModelLoader, Policy

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
EXPORT_DIR = "final"
# Seed "purposes", so that the prompt order, sampling, shuffling and evaluation draw independent streams.
_ROLLOUT, _SHUFFLE, _EVAL = 1, 2, 3


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


def new_run_dir(cfg: TrainConfig) -> Path:
    """RUN_DIR for a fresh run: output_dir/run_name, or a name from preset, KV method and time."""
    name = cfg.trainer.run_name
    if not name:
        kv = cfg.kv.method if cfg.sparse else "dense"
        name = f"{cfg.algo.preset}-{kv}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.trainer.output_dir) / name


def find_resumable(output_dir: str | Path) -> Path:
    """The most recently written run under `output_dir` that has a checkpoint (for a bare `--resume`)."""
    root = Path(output_dir)
    runs = [p.parent.parent for p in root.glob("*/checkpoints/step-*")] if root.is_dir() else []
    runs = [r for r in set(runs) if latest_checkpoint(r) is not None]
    if not runs:
        raise FileNotFoundError(f"--resume: no run with a checkpoint under {root}/; give the run directory")
    return max(runs, key=lambda r: latest_checkpoint(r).stat().st_mtime)  # type: ignore[union-attr]


def resume_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config a run was started with (RUN_DIR/config.yaml), plus `overrides` (e.g. trainer.steps=20)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"--resume {run_dir}: no {CONFIG_FILE} there; is it a sparserl run directory?"
        )
    return load_config(path, overrides)


class Trainer:
    """Owns a run: its directory, policy, engine, optimizer, schedule, data position and metric sinks.

    `task`, `eval_task` and `model_loader` replace the config's task and model (tests, notebooks); a resume
    must pass the same ones.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path | None = None,
        *,
        resume: bool = False,
        task: Any = None,
        eval_task: Any = None,
        model_loader: ModelLoader | None = None,
        console: Any = None,
    ) -> None:
        cfg.validate()
        check_backends(cfg.logging)
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
        ckpt = latest_checkpoint(self.run_dir) if resume else None
        if resume and ckpt is None:
            raise FileNotFoundError(f"--resume: {self.run_dir} has no complete checkpoint to resume from")
        if not resume and list_checkpoints(self.run_dir):
            raise FileExistsError(
                f"{self.run_dir} already holds checkpoints: resume it with `sparserl train --resume {self.run_dir}` "
                "or choose another trainer.run_name"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)

        from sparserl.tasks import make_task

        seed = cfg.trainer.seed
        torch.manual_seed(seed)
        self.task = task if task is not None else make_task(cfg.task, "train")
        self.eval_task = eval_task
        if self.eval_task is None and cfg.trainer.eval_prompts > 0:
            eval_cfg = cfg.task
            if cfg.trainer.eval_data:
                eval_cfg = dataclasses.replace(cfg.task, data=cfg.trainer.eval_data, split="test")
            self.eval_task = make_task(eval_cfg, "test")
        need_ref = cfg.algo.kl_coef > 0
        self.policy = Policy(cfg.model, model_loader, need_ref=need_ref, seed=seed)
        self.tokenizer = self.policy.tokenizer

        from sparserl.engine import RolloutEngine

        self.engine = RolloutEngine(self.policy.module, self.tokenizer, cfg.kv if cfg.sparse else None)
        self.reuse_learner_logprobs = cfg.trainer.reuse_learner_logprobs and self._single_update()
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()
        self.state = TrainerState()
        self.sampler = PromptSampler(len(self.task), seed)
        self._prompt_cache: dict[tuple[int, int], list[int]] = {}

        if ckpt is not None:
            loaded = load_checkpoint(ckpt)
            self.policy.load_weights(loaded.weights)
            self.optimizer.load_state_dict(loaded.optimizer)
            self.scheduler.load_state_dict(loaded.scheduler)
            self.state = loaded.state
            self.sampler.position = self.state.data_position
            loaded.restore_rng()
            self.resumed_from: Path | None = ckpt
        else:
            self.resumed_from = None
            save_config(cfg, self.run_dir / CONFIG_FILE)
        self.console = console

    # ------------------------------------------------------------------------------------------- setup

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        params = self.policy.trainable_parameters()
        if not params:
            raise ValueError(f"model {self.cfg.model.spec!r} has no trainable parameters")
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]  # norms and biases are not decayed
        groups = [{"params": decay, "weight_decay": o.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)

    def _single_update(self) -> bool:
        """True when pi_old can come from the learner's pass: one update per rollout batch, decoupled (or
        none) mode, a rejection-independent loss denominator, and no dropout (train mode == eval mode)."""
        cfg, module = self.cfg, self.policy.module
        dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules())
        dropout = dropout or bool(getattr(getattr(module, "config", None), "attention_dropout", 0.0))
        return (
            self.optimizer_steps_per_rollout == 1
            and cfg.algo.needs_recompute
            and cfg.algo.rejected_in_denominator
            and not dropout
        )

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps taken per training step: K epochs x mini-batches per rollout batch."""
        mini = self.cfg.optim.mini_batch_size or self.cfg.rollout_batch
        return self.cfg.optim.ppo_epochs * (self.cfg.rollout_batch // mini)

    def _make_scheduler(self) -> Any:
        from transformers import get_scheduler

        o = self.cfg.optim
        name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[o.schedule]
        total = max(1, self.cfg.trainer.steps * self.optimizer_steps_per_rollout)
        return get_scheduler(name, self.optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=total)

    # ------------------------------------------------------------------------------------------- pieces

    def _prompt_ids(self, task: Any, index: int, split: int) -> list[int]:
        from sparserl.models import encode_prompt

        key = (split, index)
        if key not in self._prompt_cache:
            self._prompt_cache[key] = encode_prompt(self.tokenizer, task[index].messages)
        return self._prompt_cache[key]

    def _rewards(self, task: Any, texts: list[str], examples: list[Any]) -> Tensor:
        """One reward per completion; a reward function that raises scores 0 and is counted."""
        scorer = getattr(task, "score", None)
        out = []
        for text, ex in zip(texts, examples, strict=True):
            if scorer is not None:
                r = scorer(text, ex)
            else:
                try:
                    r = float(task.reward(text, ex))
                except Exception:  # noqa: BLE001 - a broken reward must not stop training
                    r = 0.0
                    self.state.counters["reward/errors"] = self.state.counters.get("reward/errors", 0) + 1
            out.append(float(r) if math.isfinite(float(r)) else 0.0)
        return torch.tensor(out, dtype=torch.float32)

    def _generate(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int) -> Any:
        r = self.cfg.rollout
        return self.engine.generate(
            prompt_ids,
            n=n,
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop=list(r.stop) or None,
            seed=seed,
        )

    def _score(
        self, model: Any, prompts: list[list[int]], completions: list[list[int]], length: int
    ) -> Tensor:
        from sparserl.engine import score

        rows = score(model, prompts, completions, temperature=self.cfg.rollout.temperature)
        return pad(rows, length)[0]

    # ------------------------------------------------------------------------------------------- one step

    def rollout(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Steps 1-6: prompts, rollouts, rewards, advantages, dense old/reference log-probs, corrections."""
        cfg = self.cfg
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        indices = self.sampler.take(cfg.rollout.prompts_per_step)
        examples = [self.task[i] for i in indices]
        prompt_ids = [self._prompt_ids(self.task, i, 0) for i in indices]
        self.state.engine_seed = derive_seed(cfg.trainer.seed, step, _ROLLOUT)
        self.policy.module.eval()
        with torch.no_grad():
            rollouts = self._generate(
                prompt_ids, cfg.rollout.n, cfg.rollout.temperature, self.state.engine_seed
            )
        samples = list(rollouts.samples)
        t1 = time.perf_counter()

        completions = [list(s.completion_ids) for s in samples]
        prompts = [prompt_ids[s.prompt_index] for s in samples]
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = self._rewards(self.task, texts, [examples[s.prompt_index] for s in samples])
        advantages = advantages_from_config(rewards, cfg.algo)
        t_reward = time.perf_counter()
        logp_sampler, mask = pad([s.logprobs for s in samples])
        length = mask.shape[1]

        logp_old = logp_ref = None
        with torch.no_grad():
            if cfg.algo.needs_recompute and not self.reuse_learner_logprobs:
                logp_old = self._score(self.policy.module, prompts, completions, length)
            if cfg.algo.kl_coef > 0:
                with self.policy.reference() as ref:
                    logp_ref = self._score(ref, prompts, completions, length)
        t2 = time.perf_counter()

        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float32)
        truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.float32)
        metrics.update(
            {
                "reward/mean": rewards.mean().item(),
                "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
                "reward/max": rewards.max().item(),
                "length/mean": lengths.mean().item(),
                "length/max": lengths.max().item(),
                "length/truncated_frac": truncated.mean().item(),
                "adv/abs_mean": advantages.abs().mean().item(),
                "time/rollout": t1 - t0,
                "time/reward": t_reward - t1,
                "time/score": t2 - t_reward,
            }
        )
        metrics.update({f"rollout/{k}": float(v) for k, v in rollouts.stats.items() if _is_number(v)})
        metrics.update(
            _kv_saving(rollouts.stats, prompts, completions, cfg.rollout.max_new_tokens, cfg.sparse)
        )
        batch = Batch(prompts, completions, mask, logp_sampler, logp_old, logp_ref, advantages)
        return batch, metrics

    def learn(self, step: int, batch: Batch) -> dict[str, float]:
        """Steps 6-7: corrections, then K passes over shuffled mini-batches with gradient accumulation,
        clipping, AdamW and the lr schedule. Returns the step's loss, optimizer and correction metrics.

        Corrections are computed per micro-batch (the TIS batch normalisation is over the micro-batch's valid
        tokens, as in the reference code); their logged metrics are over the whole rollout batch. When
        `batch.logp_old` is None outside bypass mode, pi_old is the learner's own first forward pass (exact:
        one update per rollout, so the weights have not moved yet). A mini-batch whose loss or gradient is
        NaN/inf is skipped (no update) and counted.
        """
        from sparserl.engine import completion_logprobs

        cfg = self.cfg
        algo = cfg.algo
        module = self.policy.module
        module.train()
        params = self.policy.trainable_parameters()
        B = len(batch.prompts)
        mini = cfg.optim.mini_batch_size or B
        from_learner = batch.logp_old is None and algo.needs_recompute
        old_full = (
            batch.logp_sampler.clone()
            if from_learner
            else ppo_anchor(batch.logp_old, batch.logp_sampler, algo)
        )
        sums: dict[str, float] = {}
        skipped = 0
        for epoch in range(cfg.optim.ppo_epochs):
            gen = torch.Generator().manual_seed(derive_seed(cfg.trainer.seed, step, epoch, _SHUFFLE))
            order = torch.randperm(B, generator=gen)
            for start in range(0, B, mini):
                mb = order[start : start + mini]
                if (
                    from_learner
                ):  # rejected_in_denominator holds: the denominator does not depend on rejection
                    denom = loss_denominator(batch.mask[mb], algo, batch.mask[mb])
                else:  # rejection is per token / sequence, so the mini-batch's keep mask is known up front
                    _, keep_mb, _ = correction_weights(
                        old_full[mb], batch.logp_sampler[mb], batch.mask[mb], algo, batch.advantages[mb]
                    )
                    denom = loss_denominator(batch.mask[mb] & keep_mb, algo, batch.mask[mb])
                self.optimizer.zero_grad(set_to_none=True)
                finite = True
                for micro in torch.tensor_split(mb, cfg.optim.grad_accum):
                    if len(micro) == 0:
                        continue
                    idx = micro.tolist()
                    out = completion_logprobs(
                        module,
                        [batch.prompts[i] for i in idx],
                        [batch.completions[i] for i in idx],
                        temperature=cfg.rollout.temperature,
                        with_entropy=algo.entropy_coef > 0,
                    )
                    logp = out[0]
                    entropy = out[2] if len(out) > 2 else None
                    T = logp.shape[1]
                    if from_learner:
                        old_full[micro, :T] = logp.detach()
                    old = old_full[micro, :T]
                    mask = batch.mask[micro, :T]
                    weights, keep, _ = correction_weights(
                        old, batch.logp_sampler[micro, :T], mask, algo, batch.advantages[micro]
                    )
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
                        denominator=denom,
                    )
                    if not finite or not torch.isfinite(loss):
                        finite = (
                            False  # keep going without backward: pi_old of the later micro-batches is needed
                        )
                        continue
                    loss.backward()
                    for k, v in m.items():
                        if k in ("actor/loss", "actor/pg_loss", "actor/kl_ref", "actor/entropy"):
                            sums[k] = sums.get(k, 0.0) + v  # partial losses add up to the mini-batch's
                        else:
                            sums[k] = sums.get(k, 0.0) + v * len(idx) / len(mb)
                if finite:
                    max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
                    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                    finite = bool(torch.isfinite(norm))
                if finite:
                    self.optimizer.step()
                    sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + float(norm)
                else:
                    skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
                with warnings.catch_warnings():  # the schedule advances even when an update was skipped
                    warnings.filterwarnings(
                        "ignore", message="Detected call of `lr_scheduler.step", category=UserWarning
                    )
                    self.scheduler.step()
        module.eval()
        n_updates = self.optimizer_steps_per_rollout
        out = {k: v / n_updates for k, v in sums.items()}
        if n_updates - skipped > 0 and "actor/grad_norm" in sums:
            out["actor/grad_norm"] = sums["actor/grad_norm"] / (n_updates - skipped)
        self.state.counters["train/nonfinite_skips"] = (
            self.state.counters.get("train/nonfinite_skips", 0) + skipped
        )
        out["train/nonfinite_skipped_updates"] = float(skipped)
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        # whole-batch correction metrics (the rejection decisions are per token / sequence, so they match
        # the ones applied above; only the batch-normalisation factor is the whole batch's here)
        _, _, corr = correction_weights(old_full, batch.logp_sampler, batch.mask, algo, batch.advantages)
        out.update(corr)
        out["rejection_rate"] = corr.get("rollout_corr/seq_rejection_rate", 0.0)
        return out

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean reward of one sample on each held-out prompt, same seed every time (comparable over the run)."""
        if self.eval_task is None or self.cfg.trainer.eval_prompts == 0:
            return {}
        t0 = time.perf_counter()
        count = min(self.cfg.trainer.eval_prompts, len(self.eval_task))
        prompt_ids = [self._prompt_ids(self.eval_task, i, 1) for i in range(count)]
        self.policy.module.eval()
        with torch.no_grad():
            rollouts = self._generate(
                prompt_ids, 1, self.cfg.trainer.eval_temperature, derive_seed(self.cfg.trainer.seed, _EVAL)
            )
        samples = list(rollouts.samples)
        texts = self.tokenizer.batch_decode(
            [list(s.completion_ids) for s in samples], skip_special_tokens=True
        )
        examples = [self.eval_task[s.prompt_index] for s in samples]
        rewards = self._rewards(self.eval_task, texts, examples)
        self._eval_samples = list(zip(texts, examples, rewards.tolist(), strict=True))
        return {
            "eval/reward": rewards.mean().item(),
            "eval/length": float(sum(len(s.completion_ids) for s in samples) / max(1, len(samples))),
            "time/eval": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------------------------------- the run

    def _task_counters(self) -> dict[str, float]:
        """Cumulative counters of the run (reward calls/errors/timeouts, skipped updates), kept in the
        checkpoint so they survive a resume. The tasks' own counters are drained into them each step."""
        c = self.state.counters
        for task in {id(t): t for t in (self.task, self.eval_task) if t is not None}.values():
            stats = getattr(task, "stats", None)
            if stats is not None and hasattr(stats, "as_metrics"):
                for k, v in stats.as_metrics().items():
                    c[k] = c.get(k, 0.0) + float(v)
                if hasattr(stats, "reset"):
                    stats.reset()
        return dict(c)

    def save(self) -> Path:
        """Write a checkpoint of the current step."""
        self.state.data_position = self.sampler.position
        return save_checkpoint(
            self.run_dir,
            self.state,
            self.policy.weights(),
            self.optimizer,
            self.scheduler,
            keep_last=self.cfg.trainer.keep_last,
            weights_name=self.policy.weights_name,
        )

    def train(self, until_step: int | None = None) -> dict[str, Any]:
        """Run from the current step to trainer.steps (or stop after `until_step`, as a kill would); returns
        the summary (also written to RUN_DIR/summary.json when the run completes)."""
        cfg = self.cfg
        total = cfg.trainer.steps
        stop = total if until_step is None else min(total, until_step)
        sinks = MetricSinks(self.run_dir, cfg.logging, cfg.to_dict(), resume_step=self.state.step)
        progress = ProgressDisplay(total, self.state.step, enabled=cfg.logging.progress, console=self.console)
        hist = self.state.history
        started = time.perf_counter()
        try:
            if self.resumed_from is not None:
                progress.print(f"resumed from {self.resumed_from} (step {self.state.step}/{total})")
            elif "eval_before" not in hist and cfg.trainer.eval_prompts > 0:
                before = self.evaluate(0)
                hist["eval_before"] = before.get("eval/reward")
                sinks.log(0, before)
                self._print_samples(progress, "before training")
            while self.state.step < stop:
                step = self.state.step + 1
                t0 = time.perf_counter()
                batch, metrics = self.rollout(step)
                t1 = time.perf_counter()
                metrics.update(self.learn(step, batch))
                metrics["time/train"] = time.perf_counter() - t1
                self.state.step = step
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < total:
                    metrics.update(self.evaluate(step))
                metrics["time/step"] = time.perf_counter() - t0
                metrics.update(self._task_counters())
                self._accumulate(metrics)
                sinks.log(step, metrics)
                progress.update(step, metrics)
                if step == total or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0):
                    self.save()
            summary: dict[str, Any] = {}
            if self.state.step >= total:
                if cfg.trainer.eval_prompts > 0:
                    after = self.evaluate(total)
                    hist["eval_after"] = after.get("eval/reward")
                    sinks.log(total, after)
                    self._print_samples(progress, "after training")
                hist["export"] = str(self.policy.export(self.run_dir / EXPORT_DIR))
                summary = self.summary(time.perf_counter() - started)
                (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
        finally:
            progress.close()
            sinks.close()
        return summary

    def _accumulate(self, metrics: dict[str, float]) -> None:
        """Running totals the end-of-run summary reports (kept in the checkpoint, so a resume keeps them)."""
        h = self.state.history
        h.setdefault("first_reward", metrics.get("reward/mean"))
        h["last_reward"] = metrics.get("reward/mean")
        h["steps_seen"] = h.get("steps_seen", 0) + 1
        for key in (
            "rejection_rate",
            "kv/saved_fraction",
            "rollout/peak_kv_bytes",
            "kv/dense_kv_bytes",
            "time/step",
        ):
            if key in metrics and _is_number(metrics[key]) and math.isfinite(metrics[key]):
                h[f"sum:{key}"] = h.get(f"sum:{key}", 0.0) + metrics[key]
                h[f"n:{key}"] = h.get(f"n:{key}", 0) + 1

    def _mean(self, key: str) -> float | None:
        h = self.state.history
        n = h.get(f"n:{key}", 0)
        return h[f"sum:{key}"] / n if n else None

    def summary(self, wall_s: float) -> dict[str, Any]:
        """End-of-run numbers: reward before/after, KV saved, rejection rate, where everything is."""
        h = self.state.history
        ckpt = latest_checkpoint(self.run_dir)
        return {
            "steps": self.state.step,
            "eval_reward_before": h.get("eval_before"),
            "eval_reward_after": h.get("eval_after"),
            "train_reward_first_step": h.get("first_reward"),
            "train_reward_last_step": h.get("last_reward"),
            "rollouts": f"sparse ({self.cfg.kv.method}, budget {self.cfg.kv.budget})"
            if self.cfg.sparse
            else "dense",
            "kv_saved_fraction": self._mean("kv/saved_fraction"),
            "peak_kv_bytes_mean": self._mean("rollout/peak_kv_bytes"),
            "dense_kv_bytes_mean": self._mean("kv/dense_kv_bytes"),
            "rejection_rate_mean": self._mean("rejection_rate"),
            "nonfinite_skipped_updates": self.state.counters.get("train/nonfinite_skips", 0),
            "seconds_per_step": self._mean("time/step"),
            "wall_s_this_session": wall_s,
            "run_dir": str(self.run_dir),
            "metrics": str(self.run_dir / METRICS_FILE) if self.cfg.logging.jsonl else None,
            "tensorboard": str(self.run_dir / TB_DIR) if self.cfg.logging.tensorboard else None,
            "checkpoint": str(ckpt) if ckpt else None,
            "model": h.get("export"),
        }

    def _print_samples(self, progress: ProgressDisplay, when: str) -> None:
        k = self.cfg.logging.print_samples
        for text, ex, r in getattr(self, "_eval_samples", [])[:k]:
            question = ex.messages[-1]["content"] if ex.messages else ""
            progress.print(
                f"[dim]eval sample {when}[/dim] (reward {r:.2f}, answer {ex.answer!r})\n"
                f"[cyan]Q:[/cyan] {question[:300]}\n[green]A:[/green] {text[:500]}",
                highlight=False,
                markup=True,
            )


def _is_number(v: Any) -> bool:
    return (
        isinstance(v, (int, float)) and not isinstance(v, bool) or (isinstance(v, Tensor) and v.numel() == 1)
    )


def _kv_saving(
    stats: dict[str, Any], prompts: list[list[int]], completions: list[list[int]], max_new: int, sparse: bool
) -> dict[str, float]:
    """KV memory of the rollout versus a dense cache for the same batch (the engine preallocates, so both are
    allocations: rows x positions x bytes per position), and peak positions held per sequence versus dense."""
    out: dict[str, float] = {}
    dense_peak = max((len(p) + len(c) for p, c in zip(prompts, completions, strict=True)), default=0)
    per_pos, peak_bytes, peak = (
        stats.get(k) for k in ("kv_bytes_per_position", "peak_kv_bytes", "peak_kv_positions")
    )
    if per_pos and peak_bytes and _is_number(per_pos) and _is_number(peak_bytes):
        dense_bytes = float(per_pos) * len(prompts) * (max(len(p) for p in prompts) + max_new)
        out["kv/dense_kv_bytes"] = dense_bytes
        out["kv/saved_fraction"] = max(0.0, 1.0 - float(peak_bytes) / dense_bytes) if sparse else 0.0
    if peak and _is_number(peak) and dense_peak:
        out["kv/dense_peak_positions"] = float(dense_peak)
        out["kv/positions_saved_fraction"] = max(0.0, 1.0 - float(peak) / dense_peak) if sparse else 0.0
    return out
