"""The tables of scripts/user_guides.py besides TRL's GRPOConfig fields: the TrainingArguments fields GRPOConfig
inherits, verl's config keys, both projects' metric names, and what sparserl adds (five lines)."""

from __future__ import annotations

from dataclasses import dataclass

LOSS, CORRECTION, SAMPLING, TRAINING, OTHER = "loss", "correction", "sampling", "training", "other"


@dataclass(frozen=True)
class Row:
    """One of their keys: its kind, the sparserl settings that do the same (space-separated `key` or
    `key=value`, `<...>` a placeholder for their value), a note, or why it is not supported."""

    kind: str
    ours: str = ""
    note: str = ""
    why: str = ""


def eq(kind: str, ours: str, note: str = "") -> Row:
    return Row(kind, ours, note)


def no(kind: str, why: str) -> Row:
    return Row(kind, why=why)


ADDS = [
    "- Sparse-KV rollouts: the sampler decodes on a compressed KV cache (`kv.method`: R-KV, SnapKV, H2O, "
    "StreamingLLM, block-sparse `block_topk`; `kv.budget`), so a sequence's memory is bounded (docs/eviction.md).",
    "- Corrections for the sampler/learner gap that sparse, half-precision or stale rollouts open: Sparse-RL's "
    "rejection and TIS, IcePop, Geo-RS, Seq-MIS, K3-RS, SMD, verl's rejection names (`algo.preset`, docs/algorithm.md).",
    "- `sparserl bias`: does a sparse sampler bias the update, and do the corrections remove it, measured against "
    "coupled dense twins with a verdict (docs/bias.md).",
    "- A rollout layer of its own: continuous batching under a KV memory cap, APRIL partial rollouts, DARS, VCRL and "
    "dynamic sampling, tree rollouts, SPEC-RL reuse, Ray workers (docs/rollout.md, docs/sampling.md).",
    "- The mismatch measured every step (`rollout_corr/*`, the acceptance rate `alpha/*`), and float16 that trains "
    "(dynamic loss scaling, `model.fp32_lm_head`) (docs/metrics.md, docs/engine.md).",
]

# transformers' TrainingArguments fields GRPOConfig inherits, and GRPOTrainer's arguments, that users set most
# fmt: off
TRL_TRAINING = [
    ("model (GRPOTrainer)", eq(TRAINING,
        "model.spec",
        "a Hugging Face id or folder, a .gguf file, or smollm2-135m")),
    ("reward_funcs (GRPOTrainer)", eq(TRAINING,
        "task.reward",
        "'module:function' or 'file.py:function', called TRL style")),
    ("peft_config (GRPOTrainer)", eq(TRAINING,
        "model.lora model.lora_r model.lora_alpha model.lora_dropout model.lora_targets",
        "LoRA is on by default here")),
    ("per_device_train_batch_size", eq(TRAINING,
        "optim.mini_batch_size",
        "here the sequences of one optimizer step, over all learners")),
    ("gradient_accumulation_steps", eq(TRAINING, "optim.grad_accum", "micro-batches per optimizer step")),
    ("max_steps", eq(TRAINING, "trainer.steps", "rollout batches")),
    ("num_train_epochs", eq(TRAINING, "trainer.steps", "steps, not passes over the data")),
    ("max_grad_norm", eq(TRAINING, "optim.grad_clip")),
    ("lr_scheduler_type", eq(TRAINING, "optim.schedule", "constant, linear or cosine")),
    ("warmup_steps", eq(TRAINING, "optim.warmup_steps")),
    ("warmup_ratio", no(TRAINING, "give the steps: optim.warmup_steps")),
    ("weight_decay", eq(TRAINING, "optim.weight_decay")),
    ("adam_beta1", eq(TRAINING, "optim.betas", "[beta1, beta2]")),
    ("adam_beta2", eq(TRAINING, "optim.betas")),
    ("adam_epsilon", eq(TRAINING, "optim.eps")),
    ("bf16", eq(TRAINING, "model.dtype=bfloat16", "TRL's default; float32 is sparserl's")),
    ("fp16", eq(TRAINING, "model.dtype=float16", "with dynamic loss scaling (train/fp16_overflow_skips)")),
    ("gradient_checkpointing", eq(TRAINING,
        "optim.gradient_checkpointing",
        "on in TRL, off here by default")),
    ("seed", eq(TRAINING, "trainer.seed")),
    ("output_dir", eq(TRAINING,
        "trainer.output_dir trainer.run_name",
        "the run directory is output_dir/run_name")),
    ("save_steps", eq(TRAINING, "trainer.save_every")),
    ("save_total_limit", eq(TRAINING, "trainer.keep_last")),
    ("resume_from_checkpoint", Row(TRAINING, note="`sparserl train --resume RUN_DIR` (a flag, not a key)")),
    ("eval_steps", eq(TRAINING, "trainer.eval_every")),
    ("logging_steps", no(TRAINING, "every step is logged")),
    ("report_to", eq(TRAINING, "logging.tensorboard logging.wandb logging.mlflow logging.trackio")),
]
# fmt: on

# fmt: off
VERL_KEYS = [
    ("data.train_batch_size", eq(SAMPLING, "rollout.prompts_per_step", "prompts per step")),
    ("actor_rollout_ref.rollout.n", eq(SAMPLING, "rollout.n")),
    ("data.max_response_length", eq(SAMPLING, "rollout.max_new_tokens")),
    ("data.max_prompt_length", no(SAMPLING,
        "prompts are not cut: one that leaves no room for rollout.max_new_tokens follows "
        "task.on_long_prompt")),
    ("actor_rollout_ref.rollout.temperature", eq(SAMPLING, "rollout.temperature")),
    ("actor_rollout_ref.rollout.top_p", eq(SAMPLING,
        "rollout.top_p",
        "training takes < 1 with algo.keep_sampling_mask=true only")),
    ("actor_rollout_ref.rollout.top_k", eq(SAMPLING,
        "rollout.top_k",
        "-1 there is 0 here; > 0 in training with algo.keep_sampling_mask=true only")),
    ("actor_rollout_ref.rollout.name", no(OTHER,
        "the rollouts run in sparserl's own engine (a compressed KV cache is the point), not vLLM or "
        "SGLang")),
    ("actor_rollout_ref.rollout.dtype", eq(OTHER, "model.dtype", "one dtype for sampler and learner")),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", eq(OTHER,
        "rollout.kv_memory_cap",
        "a cap in bytes")),
    ("actor_rollout_ref.rollout.calculate_log_probs", Row(OTHER,
        note="always: the sampler's log-probs are recorded")),
    ("actor_rollout_ref.rollout.val_kwargs.temperature", eq(SAMPLING, "trainer.eval_temperature")),
    ("actor_rollout_ref.rollout.val_kwargs.n", no(SAMPLING, "one sample per held-out prompt")),
    ("actor_rollout_ref.actor.clip_ratio", eq(LOSS, "algo.eps_low algo.eps_high")),
    ("actor_rollout_ref.actor.clip_ratio_low", eq(LOSS, "algo.eps_low")),
    ("actor_rollout_ref.actor.clip_ratio_high", eq(LOSS, "algo.eps_high")),
    ("actor_rollout_ref.actor.clip_ratio_c", eq(LOSS,
        "algo.dual_clip_c",
        "verl always applies it (3.0); here None is off")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", eq(LOSS, "algo.policy_loss=ppo_clip")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", eq(LOSS, "algo.preset=gspo")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=sapo", eq(LOSS, "algo.policy_loss=soft_sapo")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=cispo", eq(LOSS, "algo.preset=cispo")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", eq(LOSS, "algo.policy_loss=clip_cov")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", eq(LOSS, "algo.policy_loss=kl_cov")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gpg", no(LOSS,
        "no GPG loss; a loss is a function registered with register_policy_loss")),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean", no(LOSS, "no GMPO loss (see gpg)")),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_ratio", eq(LOSS, "algo.clip_cov_ratio")),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_lb", eq(LOSS, "algo.clip_cov_lb")),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_ub", eq(LOSS, "algo.clip_cov_ub")),
    ("actor_rollout_ref.actor.policy_loss.kl_cov_ratio", eq(LOSS, "algo.kl_cov_ratio")),
    ("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", eq(LOSS, "algo.ppo_kl_coef")),
    ("actor_rollout_ref.actor.loss_agg_mode=token-mean", eq(LOSS, "algo.loss_agg_mode=token-mean")),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", eq(LOSS,
        "algo.loss_agg_mode=seq-mean-token-mean")),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum", eq(LOSS,
        "algo.loss_agg_mode=seq-mean-token-sum-norm algo.loss_token_norm=1")),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", eq(LOSS,
        "algo.loss_agg_mode=seq-mean-token-sum-norm algo.loss_token_norm=<loss_scale_factor>",
        "sparserl also divides by the sequences (Dr. GRPO's form), verl does not: the loss differs by that "
        "constant, which optim.grad_clip sees")),
    ("actor_rollout_ref.actor.entropy_coeff", eq(LOSS, "algo.entropy_coef")),
    ("actor_rollout_ref.actor.use_kl_loss", eq(LOSS, "algo.kl_coef", "on when algo.kl_coef > 0")),
    ("actor_rollout_ref.actor.kl_loss_coef", eq(LOSS, "algo.kl_coef")),
    ("actor_rollout_ref.actor.kl_loss_type=kl", eq(LOSS, "algo.kl_estimator=k1")),
    ("actor_rollout_ref.actor.kl_loss_type=mse", eq(LOSS, "algo.kl_estimator=k2")),
    ("actor_rollout_ref.actor.kl_loss_type=low_var_kl", eq(LOSS, "algo.kl_estimator=k3")),
    ("actor_rollout_ref.actor.kl_loss_type=abs", no(LOSS, "no |log ratio| estimator")),
    ("actor_rollout_ref.actor.kl_loss_type=full", no(LOSS,
        "the update has the drawn tokens' log-probs only, not the full distributions")),
    ("actor_rollout_ref.actor.ppo_epochs", eq(LOSS, "optim.ppo_epochs")),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", eq(TRAINING,
        "optim.mini_batch_size",
        "verl counts prompts, sparserl sequences (x rollout.n)")),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", eq(TRAINING,
        "optim.grad_accum",
        "a count of micro-batches, not their size")),
    ("actor_rollout_ref.actor.grad_clip", eq(TRAINING, "optim.grad_clip")),
    ("actor_rollout_ref.actor.optim.lr", eq(TRAINING, "optim.lr")),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps", eq(TRAINING, "optim.warmup_steps")),
    ("actor_rollout_ref.actor.optim.weight_decay", eq(TRAINING, "optim.weight_decay")),
    ("actor_rollout_ref.actor.optim.warmup_style", eq(TRAINING, "optim.schedule")),
    ("actor_rollout_ref.actor.strategy", eq(TRAINING, "distributed.fsdp distributed.learners", "FSDP2")),
    ("actor_rollout_ref.model.lora_rank", eq(TRAINING,
        "model.lora model.lora_r",
        "0 there: model.lora=false")),
    ("actor_rollout_ref.model.lora_alpha", eq(TRAINING, "model.lora_alpha")),
    ("actor_rollout_ref.model.target_modules", eq(TRAINING, "model.lora_targets")),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", eq(TRAINING, "optim.gradient_checkpointing")),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_modules", eq(TRAINING,
        "optim.recompute_modules=[mlp]",
        "Megatron's selective recompute (recompute_granularity=selective): 'mlp', 'layernorm', and 'mlp_act' "
        "(Megatron's 'moe_act' for a dense gated MLP)")),
    ("algorithm.adv_estimator=grpo", eq(LOSS, "algo.adv_estimator=grpo")),
    ("algorithm.adv_estimator=rloo", eq(LOSS, "algo.adv_estimator=rloo")),
    ("algorithm.adv_estimator=reinforce_plus_plus", eq(LOSS,
        "algo.preset=reinforce++",
        "whitened over sequences here, over tokens in verl")),
    ("algorithm.adv_estimator=reinforce_plus_plus_baseline", eq(LOSS, "algo.preset=reinforce++-baseline")),
    ("algorithm.adv_estimator=gae", no(LOSS, "no critic: group baselines only")),
    ("algorithm.adv_estimator=remax", no(LOSS, "no greedy-baseline rollout")),
    ("algorithm.norm_adv_by_std_in_grpo", eq(LOSS, "algo.adv_estimator=drgrpo", "false there")),
    ("algorithm.use_kl_in_reward", no(LOSS,
        "the KL to the reference is a loss term (algo.kl_coef), not a reward penalty")),
    ("algorithm.kl_ctrl.type", no(LOSS, "the KL coefficient is fixed")),
    ("algorithm.filter_groups.enable", eq(SAMPLING, "sampling.dynamic", "DAPO's dynamic sampling")),
    ("algorithm.filter_groups.max_num_gen_batches", eq(SAMPLING, "sampling.max_extra_rounds")),
    ("reward_model.overlong_buffer.len", eq(LOSS, "algo.overlong_buffer", "DAPO's recipe")),
    ("reward_model.overlong_buffer.penalty_factor", eq(LOSS, "algo.overlong_penalty")),
    ("algorithm.rollout_correction.rollout_is=token", eq(CORRECTION, "algo.tis_cap=<rollout_is_threshold>")),
    ("algorithm.rollout_correction.rollout_is=sequence", eq(CORRECTION,
        "algo.seq_tis_cap=<rollout_is_threshold>")),
    ("algorithm.rollout_correction.rollout_is_threshold", eq(CORRECTION, "algo.tis_cap algo.seq_tis_cap")),
    ("algorithm.rollout_correction.rollout_is_batch_normalize", eq(CORRECTION, "algo.tis_batch_norm")),
    ("algorithm.rollout_correction.rollout_rs", eq(CORRECTION,
        "algo.rollout_rs=[<name>:<threshold>]",
        "the names below; those with no exact rule are refused")),
    ("algorithm.rollout_correction.rollout_rs_threshold", eq(CORRECTION,
        "algo.rollout_rs",
        "the part after ':' of each entry")),
    ("algorithm.rollout_correction.bypass_mode", eq(CORRECTION,
        "algo.correction_mode=bypass",
        "false there: algo.correction_mode=decoupled")),
    ("algorithm.rollout_correction.loss_type=ppo_clip", eq(CORRECTION, "algo.policy_loss=ppo_clip")),
    ("algorithm.rollout_correction.loss_type=reinforce", no(CORRECTION,
        "no unclipped REINFORCE surrogate; kl_cov's is one, with its penalty")),
    ("custom_reward_function.path", eq(OTHER,
        "task.reward task.reward_style=verl",
        "'file.py:compute_score', called verl style")),
    ("data.train_files", eq(OTHER, "task.data")),
    ("data.val_files", eq(OTHER, "trainer.eval_data")),
    ("data.prompt_key", eq(OTHER, "task.question_key")),
    ("trainer.total_training_steps", eq(TRAINING, "trainer.steps")),
    ("trainer.save_freq", eq(TRAINING, "trainer.save_every")),
    ("trainer.test_freq", eq(TRAINING, "trainer.eval_every")),
    ("trainer.max_actor_ckpt_to_keep", eq(TRAINING, "trainer.keep_last")),
    ("trainer.default_local_dir", eq(TRAINING, "trainer.output_dir")),
    ("trainer.experiment_name", eq(TRAINING, "trainer.run_name")),
    ("trainer.logger", eq(TRAINING, "logging.tensorboard logging.wandb logging.mlflow logging.trackio")),
    ("trainer.n_gpus_per_node", eq(TRAINING, "distributed.learners distributed.gpus_per_learner")),
]
# fmt: on

# (their metric, sparserl's (space-separated; checked against docs/metrics.md), note)
# fmt: off
TRL_METRICS = [
    ("reward", "reward/mean", ""),
    ("reward_std", "reward/std", ""),
    ("rewards/<func>/mean", "",
        "the functions' rewards are logged as their weighted sum; what a function logs with log_metric is "
        "reward_fn/<name>"),
    ("frac_reward_zero_std", "sampling/zero_variance_frac", ""),
    ("completions/mean_length", "length/mean", ""),
    ("completions/max_length", "length/max", ""),
    ("completions/clipped_ratio", "length/truncated_frac", ""),
    ("num_tokens", "sampling/generated_tokens_total", "generated tokens only (TRL counts prompts too)"),
    ("kl", "actor/kl_ref", ""),
    ("entropy", "actor/entropy rollout/entropy_estimate",
        "pi_theta's with an entropy term; the sampler's estimate every step"),
    ("clip_ratio/region_mean", "actor/pg_clipfrac", "no split into low and high"),
    ("cispo_clip_ratio", "actor/pg_clipfrac", "under algo.policy_loss=cispo"),
    ("sampling/sampling_logp_difference/mean", "rollout_corr/token_mult_prob_error",
        "TRL's is mean |log xi|; NeMo-RL's mean exp(|log xi|) is the nearest here"),
    ("sampling/importance_sampling_ratio/mean", "rollout_corr/weight_mean",
        "the applied weights; before the corrections: rollout_corr/xi_mean"),
    ("sampling/importance_sampling_ratio/min", "rollout_corr/weight_min", ""),
    ("sampling/importance_sampling_ratio/max", "rollout_corr/weight_max", ""),
    ("loss", "actor/loss", ""),
    ("policy_loss", "actor/pg_loss", ""),
    ("grad_norm", "actor/grad_norm", ""),
    ("learning_rate", "actor/lr", ""),
]
# fmt: on

# fmt: off
VERL_METRICS = [
    ("critic/score/mean", "reward/mean", ""),
    ("critic/rewards/mean", "reward/mean", "verl's adds the in-reward KL penalty when on; the KL is a loss term here"),
    ("critic/advantages/mean", "adv/abs_mean", "mean |A| here"),
    ("response_length/mean", "length/mean", ""),
    ("response_length/max", "length/max", ""),
    ("response_length/clip_ratio", "length/truncated_frac", ""),
    ("actor/pg_loss", "actor/pg_loss", ""),
    ("actor/pg_clipfrac", "actor/pg_clipfrac", ""),
    ("actor/pg_clipfrac_lower", "actor/pg_clipfrac_lower", ""),
    ("actor/ppo_kl", "actor/ppo_kl", ""),
    ("actor/entropy", "actor/entropy", ""),
    ("actor/kl_loss", "actor/kl_ref", ""),
    ("actor/grad_norm", "actor/grad_norm", ""),
    ("actor/lr", "actor/lr", ""),
    ("rollout_corr/kl", "rollout_corr/kl", "the same definitions"),
    ("rollout_corr/k3_kl", "rollout_corr/k3_kl", ""),
    ("rollout_corr/training_ppl", "rollout_corr/training_ppl", ""),
    ("rollout_corr/rollout_ppl", "rollout_corr/rollout_ppl", ""),
    ("rollout_corr/log_ppl_abs_diff", "rollout_corr/log_ppl_abs_diff", ""),
    ("rollout_corr/ppl_ratio", "rollout_corr/ppl_ratio", ""),
    ("rollout_corr/chi2_token", "rollout_corr/chi2_token", ""),
    ("rollout_corr/chi2_seq", "rollout_corr/chi2_seq", ""),
    ("rollout_corr/rollout_is_mean", "rollout_corr/weight_mean",
        "after truncation; before: rollout_corr/xi_mean"),
    ("rollout_corr/rollout_is_std", "rollout_corr/xi_std", ""),
    ("rollout_corr/rollout_is_eff_sample_size", "rollout_corr/weight_ess", ""),
    ("rollout_corr/rollout_is_batch_norm_factor", "rollout_corr/batch_norm_factor", ""),
    ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/token_keep_fraction",
        "1 minus it when rejection is the only rule"),
    ("training/rollout_actor_probs_pearson_corr", "rollout_corr/pearson_corr", ""),
    ("timing_s/gen", "time/rollout", ""),
    ("timing_s/old_log_prob", "time/score", ""),
    ("timing_s/update_actor", "time/train", ""),
    ("timing_s/step", "time/step", ""),
]
# fmt: on
