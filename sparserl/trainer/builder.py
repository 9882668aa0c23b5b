"""A run's parts built and wired once its directory is locked (`build_run`): task, policy, learner, add-ons,
views, held-out evaluation, group source, advantage transforms, the rollout layer (through rollout.build: the
trainer never names a backend), a resume's checkpoint loaded into them. Also what the trainer holds besides its
loop's state: its own engine (held-out evaluation and the model-backed judges; rollouts run on the backend's),
the resources a judge may use, and the relay that carries the engines' notes to the console. None of these
holds the trainer, so a dropped Trainer is freed (and its run directory's lock released) at once."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparserl.algo import make_adv_transforms
from sparserl.config import save_config
from sparserl.config.checks import sampler_records
from sparserl.engine.decoder import max_positions
from sparserl.engine.rollout import RolloutEngine
from sparserl.engine.run_settings import engine_settings
from sparserl.rollout import RolloutState, SourceContext, TaskView, make_group_source, step_seed
from sparserl.rollout.build import build_rollout
from sparserl.rollout.records import Recording
from sparserl.trainer.acceptance import acceptance_request, check_acceptance
from sparserl.trainer.addons import make_addons, records_held
from sparserl.trainer.checkpoint import SOURCE_PART, Checkpoint, TrainerState
from sparserl.trainer.data import training_tasks, usable_rows
from sparserl.trainer.evaluation import held_out_eval
from sparserl.trainer.learner_group import make_learner
from sparserl.trainer.overlap import SAMPLER_PART, StepRollouts
from sparserl.trainer.policy import Policy
from sparserl.trainer.run_dir import CONFIG_FILE, checkpoint_to_resume

if TYPE_CHECKING:
    from sparserl.trainer.loop import Trainer


class Relay:
    """Passes messages on to `to` once it is set (the progress display while the run trains), else drops them:
    what the engines say (a decode step compiling) reaches the console."""

    def __init__(self) -> None:
        self.to: Callable[[str], None] | None = None

    def __call__(self, message: str) -> None:
        if self.to is not None:
            self.to(message)


class OwnEngine:
    """The trainer's own engine over the policy, with the run's engine settings, built at the first call: a run
    that neither evaluates nor asks a judge builds none."""

    def __init__(
        self, model: nn.Module, tokenizer: Any, settings: dict[str, Any], notify: Callable[[str], None]
    ) -> None:
        self.model, self.tokenizer, self.settings, self.notify = model, tokenizer, settings, notify
        self.engine: RolloutEngine | None = None

    def __call__(self) -> RolloutEngine:
        if self.engine is None:
            self.engine = RolloutEngine(self.model, self.tokenizer, **self.settings)
            self.engine.notify = self.notify
        return self.engine


class JudgeResources:
    """What a model-backed advantage transform (a uniqueness judge) may use: the policy's module, its tokenizer
    and autocast context, and the trainer's own engine (built when a judge first asks for it)."""

    def __init__(self, policy: Any, engine: OwnEngine) -> None:
        self.module, self.tokenizer, self.autocast = policy.module, policy.tokenizer, policy.autocast
        self._engine = engine

    @property
    def engine(self) -> RolloutEngine:
        return self._engine()


def build_run(
    trainer: Trainer, resume: bool, task: Any, eval_task: Any, model_loader: Any, reward_fn: Any
) -> None:
    """Everything a run holds, built once its directory is locked, in this order (the policy's initial weights
    draw from the seeded generator): the checkpoint to resume, the task, the policy, the engine settings, the
    learner and add-ons, the views and their usable rows, the held-out evaluation, the group source, the
    advantage transforms and the rollout layer; then the checkpoint's state loaded into them."""
    t, cfg = trainer, trainer.cfg
    ckpt = checkpoint_to_resume(t.run_dir, cfg, resume, t.notes)
    if (
        cfg.trainer.threads or cfg.rollout.overlap.active
    ):  # overlapped: half the threads each to sampler, learner
        threads = cfg.trainer.threads or torch.get_num_threads()
        torch.set_num_threads(max(1, threads // 2) if cfg.rollout.overlap.active else threads)

    seed = cfg.trainer.seed
    torch.manual_seed(seed)
    t.task, t.eval_task = training_tasks(cfg, task, eval_task, reward_fn)
    t.policy = Policy(cfg.model, model_loader, need_ref=cfg.algo.kl_coef > 0, seed=seed, distill=cfg.distill,
                      mmap_threshold=cfg.trainer.malloc_mmap_threshold)  # fmt: skip
    t.tokenizer = t.policy.tokenizer
    check_acceptance(cfg, t.policy.module.get_input_embeddings().weight.shape[0])

    settings, compile_note = engine_settings(cfg, t.policy.module)
    t.notes += [compile_note] if compile_note else []
    t.own_engine = OwnEngine(t.policy.module, t.tokenizer, settings, t.say)
    t.learner = make_learner(cfg, t.policy.module, t.policy.trainable_parameters(), t.policy.autocast)
    t.addons = make_addons(cfg, t.policy)
    t.state = TrainerState()
    t.train_view = TaskView(t.task, t.tokenizer)
    t.eval_view = TaskView(t.eval_task, t.tokenizer) if t.eval_task is not None else None
    rows = partial(usable_rows_of, t)
    t.train_rows = rows(t.train_view)
    t.held_out = held_out_eval(cfg, t.eval_view, rows, t.own_engine, t.policy)
    t.source = make_group_source(SourceContext(t.train_rows, cfg.rollout.n, seed, cfg, t.tokenizer))
    t.adv_transforms = make_adv_transforms(cfg.algo, cfg.shaping, JudgeResources(t.policy, t.own_engine))
    keeps = "algo.keep_sampling_mask" in sampler_records(cfg)
    recording = Recording(**acceptance_request(cfg), held=records_held(t.addons, cfg), kept_sets=keeps)
    # rollout.overlap: the sampler draws from a replica of the policy while the learner updates the policy
    replica = t.policy.sampler_replica() if cfg.rollout.overlap.active else None
    t.rollouts = build_rollout(cfg, replica or t.policy.module, t.tokenizer, t.train_view, recording, t.say)
    draw = partial(draw_step, t.rollouts, t.source, cfg)
    t.steps = StepRollouts(
        draw,
        t.rollouts.backend,
        t.policy.module,
        replica,
        cfg.trainer.steps,
        cfg.rollout.overlap.max_staleness,
        # the reference does not change with the version: a rollout drawn ahead gets its log-probs there
        partial(t.score_reference, replica) if replica is not None and cfg.algo.kl_coef > 0 else None,
    )
    # a KV cap too small for the first rows' prompts fails here, before any step (later rows at their step)
    longest = max(len(t.train_view.prompt_ids(r)) for r in t.train_rows[:64])
    t.rollouts.backend.check_fits(longest, cfg.rollout.max_new_tokens)
    if ckpt is not None:
        resume_run(t, ckpt)
    t.resumed_from = ckpt.path if ckpt is not None else None
    save_config(cfg, t.run_dir / CONFIG_FILE)  # a resume writes the settings it was allowed to change


def resume_run(trainer: Trainer, ckpt: Checkpoint) -> None:
    """Weights, optimizer, schedule, loop state, the source's and the add-ons' parts, then the RNGs."""
    t = trainer
    t.policy.load_weights(ckpt.weights)
    t.learner.optimizer.load_state_dict(ckpt.optimizer)
    t.learner.scheduler.load_state_dict(ckpt.scheduler)
    t.state = ckpt.state
    t.source.load_state_dict(ckpt.parts[SOURCE_PART].state)
    t.rollouts.state = RolloutState(**t.state.rollout)
    t.steps.resume(ckpt.parts.get(SAMPLER_PART), t.state.step)
    for addon in t.addons:
        addon.resume(ckpt)
        t.notes += addon.notes
    ckpt.restore_rng()


def draw_step(rollouts: Any, source: Any, cfg: Any, step: int, drawn_by: int) -> Any:
    """Step `step`'s groups from the rollout layer, drawn by policy `drawn_by` (the learner's version, step - 1,
    unless the rollout runs ahead of the update), on the step's own random streams, with the reward counters
    and logged metrics of its own reward calls."""
    version = step - 1
    seed = step_seed(cfg.trainer.seed, version)
    got = rollouts.collect_step(source, cfg.rollout.prompts_per_step, version, seed, drawn_by)
    # the task's counters and logged metrics go with the step they belong to, not the step that drains them
    got.task_counters, got.logged = rollouts.task.drain_counters(), rollouts.task.drain_logged()
    return got


def usable_rows_of(trainer: Trainer, view: TaskView, want: int | None = None) -> list[int]:
    """`data.usable_rows` for the run's model and rollout length; its note is said when the run starts."""
    cfg = trainer.cfg
    rows, note = usable_rows(
        view.task,
        lambda i: len(view.prompt_ids(i)),
        max_positions(trainer.policy.module),
        cfg.rollout.max_new_tokens,
        cfg.task.on_long_prompt,
        want,
    )
    if note:
        trainer.notes.append(note)
    return rows
