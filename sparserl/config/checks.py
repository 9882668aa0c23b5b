"""The checks of a training config that span its sections (each section checks its own fields when built):
batch shapes, what the compiled decode and alpha logging can run, DistillSparse's needs, and sampling settings
that training cannot correct for. What a registered class needs is read from the class (an estimator's
`min_group`); the group sources' own checks run from what they declare (rollout/sampling.py
`check_group_sources`, at the trainer's start)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from sparserl.algo.advantages import ADV_ESTIMATORS
from sparserl.algo.keep_sampling import truncates
from sparserl.config.errors import ConfigError
from sparserl.config.switches import check_switches
from sparserl.engine.kv_config import EVICTION_METHODS, SELECTORS

if TYPE_CHECKING:  # the config's type only: sections.py calls these
    from sparserl.config.sections import TrainConfig


def sparse_kv_methods() -> str:
    """The registered kv.method values that sample sparsely, for errors that ask for one."""
    return (
        f"an evicting method ({', '.join(EVICTION_METHODS)}) or a block-sparse one ({', '.join(SELECTORS)}), "
        "or set kv.quant=int8|fp8"
    )


def cross_section_checks(cfg: TrainConfig) -> None:
    """The checks that span sections of a TrainConfig (each section checks its own fields)."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n
    least = ADV_ESTIMATORS.lookup(cfg.algo.adv_estimator).min_group
    if cfg.rollout.n < least:
        raise ConfigError(
            f"algo.adv_estimator={cfg.algo.adv_estimator} needs rollout.n >= {least} (its baseline needs groups "
            f"of {least} samples)"
        )
    mini = cfg.optim.mini_batch_size or batch
    if batch % mini:
        raise ConfigError(
            f"optim.mini_batch_size={mini} must divide the rollout batch "
            f"(rollout.prompts_per_step * rollout.n = {batch})"
        )
    if cfg.optim.grad_accum > mini:
        raise ConfigError(
            f"optim.grad_accum={cfg.optim.grad_accum} exceeds the mini-batch size {mini}: "
            "each micro-batch needs at least one sequence"
        )
    check_distributed(cfg)
    if cfg.algo.overlong_buffer > cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"algo.overlong_buffer={cfg.algo.overlong_buffer} exceeds rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}: every completion would be penalised"
        )
    check_distill(cfg)  # before the recording check: it says why DistillSparse needs whole samples
    recording = sampler_records(cfg)
    if recording and cfg.rollout.partial.enable:
        raise ConfigError(
            f"{' and '.join(recording)} read(s) what the sampler recorded for every token of a sample; with "
            "rollout.partial.enable=true a resumed sample's earlier distributions are gone: turn one of them off"
        )
    check_sampling(cfg)
    check_switches(cfg)
    if cfg.algo.sparse_rollout and not cfg.kv.sparse:
        raise ConfigError(
            f"algo.preset={cfg.algo.preset!r} samples sparse rollouts but kv.method={cfg.kv.method!r}; "
            f"set kv.method to {sparse_kv_methods()}, or use algo.preset=dense"
        )


def sampler_records(cfg: TrainConfig) -> list[str]:
    """The settings that need the sampler to record each token's distribution (alpha, DistillSparse's replay,
    the keep-sampling mask's kept sets): they need whole samples, drawn by this run's own sampler."""
    keep = cfg.algo.keep_sampling_mask and truncates(cfg.rollout.top_p, cfg.rollout.top_k)
    on = {"trainer.log_acceptance": cfg.trainer.log_acceptance, "distill.enable": cfg.distill.enable,
          "algo.keep_sampling_mask": keep}  # fmt: skip
    return [k for k, v in on.items() if v]


def check_sampling(cfg: TrainConfig) -> None:
    """Training samples from the tempered softmax, or truncates it under the keep-sampling mask; warns where
    stale tokens go uncorrected."""
    r = cfg.rollout
    if truncates(r.top_p, r.top_k) and not cfg.algo.keep_sampling_mask:
        raise ConfigError(
            f"rollout.top_p={r.top_p}, rollout.top_k={r.top_k}: the sampler records log-probs of the truncated "
            "distribution while pi_old, the learner and the reference use the full softmax, a mismatch the "
            "corrections would mistake for sparsity. Set algo.keep_sampling_mask=true (all of them renormalised "
            "over the sampler's kept set), or top_p=1 and top_k=0"
        )
    if r.partial.enable and r.partial.mode == "train_all" and cfg.algo.correction_mode == "none":
        warnings.warn(
            "rollout.partial.mode=train_all with algo.correction_mode=none trains the tokens an older policy "
            "drew as if the current one had drawn them, with no staleness correction: set "
            "algo.correction_mode=decoupled (or bypass) to weigh them, or rollout.partial.mode=mask_old",
            UserWarning,
            stacklevel=2,
        )


def check_distill(cfg: TrainConfig) -> None:
    """DistillSparse needs sparse rollouts it can replay teacher-forced: block_topk, whole samples."""
    d = cfg.distill
    if not d.enable:
        return
    if not (cfg.algo.sparse_rollout and cfg.kv.sparse):
        raise ConfigError(
            f"distill.enable=true trains an adapter for sparse rollouts, but rollouts are dense "
            f"(algo.preset={cfg.algo.preset!r}, kv.method={cfg.kv.method!r}): set kv.method to "
            f"{sparse_kv_methods()} and a sparse preset (e.g. algo.preset=tis), or distill.enable=false"
        )
    if cfg.model.lora and d.adapter_name == "default":
        raise ConfigError(
            "distill.adapter_name='default' is the name of the policy's own LoRA adapter (model.lora=true): "
            "choose another name"
        )
    if cfg.kv.quantized:
        raise ConfigError(
            f"distill.enable=true with kv.quant={cfg.kv.quant!r} is not implemented: the teacher-forced replay "
            "of the sparse sampler reads full-precision keys and values; use kv.quant=none"
        )
    if cfg.rollout.partial.enable or cfg.rollout.kv_memory_cap is not None:
        raise ConfigError(
            "distill.enable=true needs each sample decoded in one go: a resumed or preempted sample is "
            "re-prefilled densely, which the sparse replay cannot reproduce; unset rollout.partial.enable "
            "and rollout.kv_memory_cap"
        )


def check_learners(cfg: TrainConfig) -> None:
    """Learner ranks share each mini-batch's micro-batches evenly and train the policy's weights only."""
    n = cfg.distributed.learners
    if n == 1:
        return
    if cfg.optim.grad_accum % n:
        raise ConfigError(
            f"optim.grad_accum={cfg.optim.grad_accum} must be a multiple of distributed.learners={n}: the "
            "learners share each mini-batch's micro-batches (the same ones as one learner's, so the update is "
            "the same), and each needs its equal share"
        )
    if cfg.distill.enable:
        raise ConfigError(
            f"distill.enable=true with distributed.learners={n} is not implemented: DistillSparse trains its "
            "adapter in the trainer's process beside one learner; use distributed.learners=1"
        )


def check_distributed(cfg: TrainConfig) -> None:
    """Learners share the update; what the rollout backend can do is its own check (rollout/backend.py
    `check_backend`, from what the backend declares)."""
    check_learners(cfg)
