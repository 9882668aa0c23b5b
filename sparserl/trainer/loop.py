"""The training loop: a group source plans the step's groups, the rollout layer runs them on a backend (sparse or
dense) and scores them, the groups go back to the source, advantages over group ids, dense old/reference
log-probs, corrections, K passes of AdamW over mini-batches, the add-on learners, metrics, checkpoint. The
local backend sees the new weights because the engine reads the trained model's weights afresh at every run.
docs/algorithm.md walks through one step."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sparserl.algo import advantages_from_config
from sparserl.algo.keep_sampling import padded_kept
from sparserl.algo.reward_shaping import overlong_penalty
from sparserl.config import TrainConfig
from sparserl.engine.padding import right_pad
from sparserl.engine.rollout import RolloutEngine
from sparserl.rollout import step_seed
from sparserl.rollout.build import check_rollout
from sparserl.rollout.records import SampleRecord
from sparserl.trainer import distill as _distill  # noqa: F401 - registers the DistillSparse add-on
from sparserl.trainer import judges as _judges  # noqa: F401 - registers the model-backed uniqueness judges
from sparserl.trainer.acceptance import acceptance_step_metrics
from sparserl.trainer.addons import dense_logprobs_needed
from sparserl.trainer.builder import Relay, build_run
from sparserl.trainer.checkpoint import SOURCE_PART, Part, save_checkpoint
from sparserl.trainer.completions import completion_rows, with_stats
from sparserl.trainer.console import step_numbers
from sparserl.trainer.logging import MetricSinks, ProgressDisplay, check_backends, rollout_metrics
from sparserl.trainer.policy import ModelLoader
from sparserl.trainer.run_dir import RunLock, new_run_dir
from sparserl.trainer.summary import accumulate, run_summary
from sparserl.trainer.update import Batch

SUMMARY_FILE = "summary.json"
TOKENS_SPENT = "sampling/generated_tokens_total"  # cumulative, in the checkpoint: sampling.token_budget
EXPORT_DIR = "final"


class Trainer:
    """Owns a run: its directory, policy, optimizer, schedule, data position, rollout layer and metric sinks,
    built by `builder.build_run`; runs its steps.

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
        reward_fn: Any = None,
        console: Any = None,
    ) -> None:
        self._lock: RunLock | None = None
        cfg.validate()
        check_rollout(cfg)  # before anything loads: what the sources and the backend declare
        check_backends(cfg.logging)
        self.cfg = cfg
        self.console = console
        self.notes: list[str] = []  # said once the run starts (e.g. a damaged checkpoint skipped)
        self.stop_check: Callable[[], None] | None = None  # called before each step (SIGTERM: stop there)
        self.say = Relay()  # the engines' notes, to the progress display while `train` runs
        self.run_dir = Path(run_dir) if run_dir is not None else new_run_dir(cfg)
        created = not self.run_dir.exists() or (run_dir is None and not any(self.run_dir.iterdir()))
        if resume and not self.run_dir.is_dir():
            raise FileNotFoundError(
                f"--resume: {self.run_dir} does not exist, so there is no complete checkpoint"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock = RunLock(self.run_dir)
            build_run(self, resume, task, eval_task, model_loader, reward_fn)
        except BaseException:
            self.close()
            if created:  # a failed start leaves no empty run directory behind
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def close(self) -> None:
        """Release the run directory (the lock); the Trainer should not be used afterwards."""
        if getattr(self, "steps", None) is not None:
            self.steps.close()
        if getattr(self, "rollouts", None) is not None:
            self.rollouts.close()
        if getattr(self, "learner", None) is not None:
            self.learner.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.learner.optimizer

    @property
    def scheduler(self) -> Any:
        return self.learner.scheduler

    # ------------------------------------------------------------------------------------------- pieces

    @property
    def engine(self) -> RolloutEngine:
        """The trainer's own engine (held-out evaluation, the model-backed judges), built when first asked for;
        rollouts run on the backend's."""
        return self.own_engine()

    def push_weights(self, version: int) -> None:
        """The backend holds policy `version`; one that samples from copies gets the trainable tensors."""
        self.steps.push(version)

    def _rollout_states(self) -> dict[str, Any]:
        """What a step's rollout starts from: the group source's and the layer's states (a checkpoint taken
        while the next one is drawn ahead keeps these, so that a resume draws it again)."""
        return {"source": self.source.state_dict(), "layer": dataclasses.asdict(self.rollouts.state)}

    def _score(
        self,
        model: Any,
        prompts: list[list[int]],
        completions: list[list[int]],
        length: int,
        kept: Tensor | None = None,
    ) -> Tensor:
        from sparserl.engine import score

        with self.policy.autocast():
            rows = score(model, prompts, completions, temperature=self.cfg.rollout.temperature, kept=kept)
        return right_pad(rows, torch.float32, width=length)[0]

    # ------------------------------------------------------------------------------------------- one step

    def rollout(self, step: int) -> tuple[Batch, dict[str, float]]:
        """Steps 1-6: the source's plans, complete scored groups from the rollout layer (and back to the
        source), advantages over group ids, dense old/reference log-probs."""
        cfg, t0 = self.cfg, time.perf_counter()
        self.state.engine_seed = step_seed(cfg.trainer.seed, step - 1)  # the policy that trains on it
        got = self.steps.take(step, self._rollout_states)  # drawn now, or ahead while step - 1 updated
        spent = self.state.counters.get(TOKENS_SPENT, 0.0) + got.sampling["generated_tokens"]
        self.state.counters[TOKENS_SPENT] = spent
        samples = [s for g in got.groups for s in g.samples]
        t1 = time.perf_counter()
        rewards, penalty = self._rewards(samples)
        batch = self._batch(samples, rewards, self._kept_sets(got), got.ref_logps)
        batch.held = [seg.held for seg in got.recorded] if self.rollouts.backend.recording.held else None
        batch.truncated = torch.tensor([s.finish_reason == "length" for s in samples])
        batch.versions = right_pad([s.versions for s in samples], torch.long)[0]
        t2 = time.perf_counter()
        with self.policy.autocast():
            metrics = acceptance_step_metrics(cfg, self.policy.module, batch.prompts, got.recorded)
        shaping = {f"shaping/{k}": v for t in self.adv_transforms for k, v in t.metrics().items()}
        planned = {**self.source.metrics(), **shaping, "time/rollout": t1 - t0, "time/score": t2 - t1}
        metrics.update(rollout_metrics(cfg, got, samples, batch, penalty, planned))
        self._count(got.task_counters)
        batch.table = completion_rows(
            step, samples, batch.advantages, self.train_view, cfg.logging.completions
        )
        return batch, metrics

    def _rewards(self, samples: list[SampleRecord]) -> tuple[Tensor, Tensor]:
        """The rewards the advantages take: the task's, plus DAPO's overlong penalty (zero when off)."""
        raw = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        lengths = torch.tensor([len(s.tokens) for s in samples])
        caps = torch.tensor([s.max_new_tokens or self.cfg.rollout.max_new_tokens for s in samples])
        penalty = overlong_penalty(
            lengths, caps, self.cfg.algo.overlong_buffer, self.cfg.algo.overlong_penalty
        )
        return raw + penalty, penalty

    def _kept_sets(self, got: Any) -> list[Tensor]:
        """The sampler's kept sets of each trained sample (the keep-sampling mask), else []."""
        return (
            [seg.distributions.kept for seg in got.recorded]
            if self.rollouts.backend.recording.kept_sets
            else []
        )

    def score_reference(self, replica: Any, got: Any) -> None:
        """The reference's log-probs of a rollout drawn ahead, on the sampler's thread with the sampler's
        `replica` (adapters off, or the frozen copy), while the learner updates (rollout.overlap): the
        reference does not depend on the policy version, so they need not wait for the update."""
        samples = [s for g in got.groups for s in g.samples]
        width = max((len(s.tokens) for s in samples), default=0)
        prompts, completions, kept_sets = self._scoring_inputs(samples, self._kept_sets(got), width)
        with self.policy.reference(replica) as ref:
            got.ref_logps = self._score(ref, prompts, completions, width, kept_sets)

    def _scoring_inputs(
        self, samples: list[SampleRecord], kept: list[Tensor], width: int
    ) -> tuple[list[list[int]], list[list[int]], Tensor | None]:
        """The prompts and completions of `samples` as the scorers take them, and the sampler's kept sets
        padded to `width` positions (None without the keep-sampling mask)."""
        completions = [list(s.tokens) for s in samples]
        prompts = [self.train_view.prompt_ids(s.prompt_id) for s in samples]
        kept_sets = padded_kept(kept, [len(c) for c in completions], width) if kept else None
        return prompts, completions, kept_sets

    def _batch(
        self, samples: list[SampleRecord], rewards: Tensor, kept: list[Tensor], ref: Tensor | None = None
    ) -> Batch:
        """The learner's batch: padded tokens and masks, advantages over group ids, and the dense pi_old and
        reference log-probs where they are needed (pi_old taken from the learner's own pass when it can; the
        reference's, `ref` [B, T], when scored beside the rollout), over the sampler's kept sets `kept` (per
        sample; empty: no keep-sampling mask)."""
        cfg = self.cfg
        logp_sampler, mask = right_pad([s.sampler_logps for s in samples], torch.float32)
        length = mask.shape[1]
        prompts, completions, kept_sets = self._scoring_inputs(samples, kept, length)
        group_index = [s.group_id for s in samples]
        texts = [s.text or "" for s in samples]
        task_rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # before shaping
        advantages = advantages_from_config(
            rewards, group_index, cfg.algo, texts, self.adv_transforms, completions, task_rewards
        )
        mask &= right_pad([s.loss_mask for s in samples])[
            0
        ].bool()  # 0: a stale token (partial.mode=mask_old)
        logp_old = logp_ref = None
        with torch.no_grad():
            if (
                cfg.algo.needs_recompute or dense_logprobs_needed(self.addons)
            ) and not self.reuses_learner_logprobs(len(samples)):
                logp_old = self._score(self.policy.module, prompts, completions, length, kept_sets)
            if cfg.algo.kl_coef > 0 and ref is not None:
                logp_ref = ref
            elif cfg.algo.kl_coef > 0:
                with self.policy.reference() as model:
                    logp_ref = self._score(model, prompts, completions, length, kept_sets)
        return Batch(prompts, completions, mask, logp_sampler, logp_old, logp_ref, advantages, kept=kept_sets)

    def reuses_learner_logprobs(self, batch_size: int) -> bool:
        """pi_old taken from the learner's own first pass (trainer.reuse_learner_logprobs) where that is exact:
        one update on this batch, and no add-on that needs the dense log-probs before the update."""
        return (
            self.cfg.trainer.reuse_learner_logprobs
            and self.learner.single_update(batch_size)
            and not dense_logprobs_needed(self.addons)
        )

    def learn(self, step: int, batch: Batch) -> dict[str, float]:
        """Steps 6-7: corrections and K passes of AdamW (trainer/update.py), then each add-on learner; the
        backend is handed the new weights. Skipped updates are counted."""
        out = self.learner.update(step, batch)
        for addon in self.addons:
            out.update(addon.update(step, batch, self.scheduler.get_last_lr()[0]))
        self.steps.updated(step)
        skips = self.state.counters.get("train/nonfinite_skips", 0) + out["train/nonfinite_skipped_updates"]
        self.state.counters["train/nonfinite_skips"] = skips
        return out

    def evaluate(self, step: int) -> dict[str, float]:
        """The held-out evaluation (trainer/evaluation.py); {} without held-out prompts."""
        return self.held_out() if self.held_out is not None else {}

    # ------------------------------------------------------------------------------------------- the run

    def _task_counters(self) -> dict[str, float]:
        """Cumulative counters of the run (reward calls/errors/timeouts, skipped updates), kept in the
        checkpoint so they survive a resume. The held-out task's are drained into them here, the training
        task's with each step's rollout (`rollout`)."""
        self._count(self.eval_view.drain_counters() if self.eval_view is not None else {})
        return dict(self.state.counters)

    def _count(self, counts: dict[str, float]) -> None:
        """Add `counts` to the run's cumulative counters."""
        c = self.state.counters
        for k, v in counts.items():
            c[k] = c.get(k, 0.0) + float(v)

    def save(self) -> Path:
        """Write a checkpoint of the current step."""
        started, sampler_parts = self.steps.checkpoint(
            self._rollout_states()
        )  # overlapped: the sampler's part
        self.state.rollout = started["layer"]
        parts = {SOURCE_PART: Part(state=started["source"]), **sampler_parts}
        parts.update({addon.name: addon.part() for addon in self.addons})
        return save_checkpoint(
            self.run_dir,
            self.state,
            self.policy.weights(),
            self.optimizer,
            self.scheduler,
            keep_last=self.cfg.trainer.keep_last,
            weights_name=self.policy.weights_name,
            parts=parts,
        )

    def finished(self) -> bool:
        """trainer.steps done, or sampling.token_budget drawn."""
        budget = self.cfg.sampling.token_budget
        spent = self.state.counters.get(TOKENS_SPENT, 0.0)
        return self.state.step >= self.cfg.trainer.steps or (budget > 0 and spent >= budget)

    def train(self, until_step: int | None = None) -> dict[str, Any]:
        """Run from the current step to trainer.steps (or stop after `until_step`, as a kill would); returns
        the summary (also written to RUN_DIR/summary.json when the run completes)."""
        cfg = self.cfg
        total = cfg.trainer.steps
        stop = total if until_step is None else min(total, until_step)
        sinks = MetricSinks(self.run_dir, cfg.logging, cfg.to_dict(), resume_step=self.state.step)
        progress = ProgressDisplay(
            total, self.state.step, cfg.logging.progress, self.console, lambda m: step_numbers(cfg, m)
        )
        # engine.compile: each graph's compile is said on the console, not a silent minute
        self.say.to = progress.print
        hist = self.state.history
        started = time.perf_counter()
        try:
            for note in self.notes:
                progress.print(note)
            if self.resumed_from is not None:
                progress.print(f"resumed from {self.resumed_from} (step {self.state.step}/{total})")
            elif "eval_before" not in hist and cfg.trainer.eval_prompts > 0:
                progress.phase("evaluating before training")
                before = self.evaluate(0)
                hist["eval_before"] = before.get("eval/dense/reward")
                hist["eval_sparse_before"] = before.get("eval/sparse/reward")
                sinks.log(0, before)
                self.held_out.print_samples(progress, "before training")
            while self.state.step < stop and not self.finished():
                if self.stop_check is not None:
                    self.stop_check()
                step = self.state.step + 1
                t0, cpu0 = time.perf_counter(), time.process_time()
                progress.phase(f"step {step}: sampling")
                batch, metrics = self.rollout(step)
                t1 = time.perf_counter()
                progress.phase(f"step {step}: updating")
                metrics.update(self.learn(step, batch))
                sinks.log_completions(step, with_stats(batch.table, self.learner))
                metrics["time/train"] = time.perf_counter() - t1
                self.state.step = step
                if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and not self.finished():
                    metrics.update(self.evaluate(step))
                metrics["time/step"] = time.perf_counter() - t0
                metrics["time/step_cpu"] = time.process_time() - cpu0
                metrics.update(self._task_counters())
                accumulate(self.state.history, metrics)
                sinks.log(step, metrics)
                progress.update(step, metrics)
                if self.finished() or (cfg.trainer.save_every and step % cfg.trainer.save_every == 0):
                    self.save()
            summary: dict[str, Any] = {}
            if self.finished():
                if cfg.trainer.eval_prompts > 0:
                    progress.phase("evaluating after training", after_steps=True)
                    after = self.evaluate(self.state.step)
                    hist["eval_after"] = after.get("eval/dense/reward")
                    hist["eval_sparse_after"] = after.get("eval/sparse/reward")
                    sinks.log(self.state.step, after)
                    self.held_out.print_samples(progress, "after training")
                hist["export"] = str(self.policy.export(self.run_dir / EXPORT_DIR))
                summary = run_summary(self, time.perf_counter() - started)
                (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
        finally:
            progress.close()
            sinks.close()
        return summary
