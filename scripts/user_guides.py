"""Write docs/from_trl.md and docs/from_verl.md: TRL's and verl's config keys and metric names mapped to sparserl's.

The mappings are data (TRL's below, verl's and both metric tables in scripts/guide_rows.py); every sparserl key
they name is checked against the config (a `key=value` is loaded with `load_config`, so a wrong value fails too),
every sparserl metric against docs/metrics.md, and the alias tables the config itself accepts (TRL's and verl's
key names, loss names, verl's rejection names) are read from the config's modules, so the guides cannot drift
from the code. tests/test_user_guides.py regenerates both files and compares them with the committed ones.

    python scripts/user_guides.py          # write both guides and the goal in docs/results/ecosystem.json
    python scripts/user_guides.py --check  # compare with the committed files; exit 1 on drift or a missing row
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from guide_rows import (  # noqa: E402
    ADDS,
    CORRECTION,
    LOSS,
    OTHER,
    SAMPLING,
    TRAINING,
    TRL_METRICS,
    TRL_TRAINING,
    VERL_KEYS,
    VERL_METRICS,
    Row,
    eq,
    no,
)

TRL_SOURCE = "huggingface/trl trl/trainer/grpo_config.py at commit f2cd577 (July 2026)"
VERL_SOURCE = "volcengine/verl's trainer configs at commit b178a3c (January 2026)"
# their GRPO as it is: a dense sampler, no correction (the default run samples sparse, with Sparse-RL's)
PLAIN = "kv.method=dense algo.preset=dense"
GOAL = (
    "Every TRL GRPOConfig loss/correction/sampling field has an equivalent or a 'not supported: why' row in "
    "docs/from_trl.md"
)
VLLM = "the rollouts run in sparserl's own engine (a compressed KV cache is the point), not vLLM"

# TRL's GRPOConfig fields, in its order; a field with values that map differently has a row per value.
# fmt: off
TRL_FIELDS: list[tuple[str, Row]] = [
    ("learning_rate", eq(TRAINING, "optim.lr", "TRL's default 1e-6, sparserl's 1e-4 (LoRA)")),
    ("model_init_kwargs", no(OTHER,
        "models load from model.spec (a Hugging Face id or folder, a .gguf file) in model.dtype; no other "
        "loading arguments")),
    ("trust_remote_code", no(OTHER,
        "the engine runs the decoder architectures it knows (Llama, Mistral, Qwen2, Qwen3), never a "
        "model's own code")),
    ("router_aux_loss_coef", no(LOSS,
        "mixture-of-experts models are not supported (dense decoders only), so there is no router loss")),
    ("disable_dropout", no(OTHER,
        "dropout stays as the model has it; pi_old is taken from the learner's own pass only when there is "
        "none (trainer.reuse_learner_logprobs)")),
    ("cast_lm_head_to_fp32", eq(CORRECTION,
        "model.fp32_lm_head",
        "also with tied embeddings: the head's weight is not converted, its matmul runs in float32, "
        "sampler and learner")),
    ("remove_unused_columns", eq(OTHER,
        "task.reward",
        "every dataset column reaches the reward functions as a keyword argument (TRL style)")),
    ("num_generations", eq(SAMPLING, "rollout.n")),
    ("num_generations_eval", no(SAMPLING,
        "evaluation draws one sample per held-out prompt (trainer.eval_prompts), its reward the pass@1 the "
        "arms compare on")),
    ("max_completion_length", eq(SAMPLING, "rollout.max_new_tokens")),
    ("ds3_gather_for_generation", no(OTHER,
        "no DeepSpeed: sharded learners are FSDP2 (distributed.fsdp) and the rollouts run on the trainer's "
        "whole copy")),
    ("shuffle_dataset", eq(OTHER, "trainer.seed", "prompts are always drawn in an order seeded by it")),
    ("pad_to_multiple_of", no(OTHER, "the engine pads its own batches (engine.compile buckets rows)")),
    ("generation_batch_size", eq(SAMPLING,
        "rollout.prompts_per_step rollout.n",
        "the rollout batch is prompts_per_step x n samples")),
    ("steps_per_generation", eq(SAMPLING,
        "optim.mini_batch_size",
        "optimizer steps per rollout batch = prompts_per_step x n / mini_batch_size (x optim.ppo_epochs)")),
    ("temperature", eq(SAMPLING,
        "rollout.temperature",
        "the learner and pi_old score at it too; rollout.sampler_temperature lets the sampler alone differ")),
    ("top_p", eq(SAMPLING,
        "rollout.top_p",
        "training takes < 1 with algo.keep_sampling_mask=true only (pi_old, the learner and the reference "
        "renormalised over the sampler's kept set; else the ratios would compare a truncated distribution with a "
        "full softmax)")),
    ("top_k", eq(SAMPLING, "rollout.top_k", "0 disables, as TRL's; > 0 in training as top_p < 1")),
    ("min_p", no(SAMPLING,
        "the engine samples with temperature, top-k and top-p only; like them, a min-p cut would make the "
        "sampler's log-probs differ from pi_old's full softmax")),
    ("generation_kwargs", no(SAMPLING,
        "the engine is not transformers' generate; its options are the rollout.* keys (stop strings: "
        "rollout.stop)")),
    ("chat_template_kwargs", no(OTHER,
        "prompts go through the tokenizer's chat template with task.system_prompt and task.instruction; no "
        "extra arguments")),
    ("repetition_penalty", no(SAMPLING,
        "a penalty changes the sampled distribution away from pi_old's, which the corrections would then "
        "count as mismatch")),
    ("cache_implementation", eq(OTHER,
        "kv.method",
        "the KV cache while sampling: dense, or a sparse one (rkv, snapkv, h2o, streaming_llm, random, "
        "block_topk)")),
    ("use_vllm", eq(OTHER,
        "rollout.backend distributed.rollout_workers",
        "the rollouts run in sparserl's own engine (a compressed KV cache is the point), not vLLM; rollout "
        "workers on Ray decode in other processes")),
    ("vllm_mode", eq(OTHER,
        "rollout.backend",
        "'server' ~ rollout.backend=ray with workers; 'colocate' ~ the default local backend in the "
        "trainer's process")),
    ("vllm_model_impl", no(OTHER,
        "the rollouts run in sparserl's own engine (a compressed KV cache is the point), not vLLM")),
    ("vllm_enable_sleep_mode", no(OTHER,
        "the rollouts run in sparserl's own engine (a compressed KV cache is the point), not vLLM; its "
        "cache lives only while a batch decodes")),
    ("vllm_structured_outputs_regex", no(OTHER,
        "no constrained decoding: it would change the sampled distribution away from pi_old's")),
    ("vllm_server_base_url", eq(OTHER, "distributed.ray_address", "workers join a Ray cluster")),
    ("vllm_server_host", eq(OTHER, "distributed.ray_address")),
    ("vllm_server_port", eq(OTHER, "distributed.ray_address")),
    ("vllm_server_timeout", eq(OTHER, "distributed.start_timeout_s")),
    ("vllm_group_port", no(OTHER, "Ray picks the weight broadcast's rendezvous (distributed.weight_sync)")),
    ("vllm_gpu_memory_utilization", eq(OTHER,
        "rollout.kv_memory_cap",
        "a cap in bytes on the rollout's KV cache")),
    ("vllm_max_model_length", no(OTHER,
        "the model's context is read from its config; a prompt that leaves no room for "
        "rollout.max_new_tokens follows task.on_long_prompt")),
    ("vllm_tensor_parallel_size", no(OTHER, "no tensor parallelism: one device per rollout worker")),
    ("beta", eq(LOSS, "algo.kl_coef", "0 (the default in both) builds no reference model")),
    ("num_iterations", eq(LOSS, "optim.ppo_epochs")),
    ("epsilon", eq(LOSS, "algo.eps_low algo.eps_high", "TRL's epsilon_high defaults to epsilon: set both")),
    ("delta", eq(LOSS,
        "algo.dual_clip_c",
        "INTELLECT-2's two-sided clip caps the ratio at delta, which only acts where A < 0: the dual clip, "
        "loss capped at -c A")),
    ("epsilon_high", eq(LOSS, "algo.eps_high", "with cispo too (eps_max there)")),
    ("sapo_temperature_neg", eq(LOSS, "algo.tau_neg")),
    ("sapo_temperature_pos", eq(LOSS, "algo.tau_pos")),
    ("vespo_k_pos", no(LOSS,
        "no VESPO loss; a loss is a function registered with register_policy_loss (algo/losses.py)")),
    ("vespo_lambda_pos", no(LOSS, "no VESPO loss (see vespo_k_pos)")),
    ("vespo_k_neg", no(LOSS, "no VESPO loss (see vespo_k_pos)")),
    ("vespo_lambda_neg", no(LOSS, "no VESPO loss (see vespo_k_pos)")),
    ("importance_sampling_level=token", eq(LOSS, "algo.policy_loss=ppo_clip")),
    ("importance_sampling_level=sequence", eq(LOSS,
        "algo.preset=gspo",
        "GSPO: algo.policy_loss=gspo with its clip range and loss_agg_mode=seq-mean-token-mean")),
    ("reward_weights", eq(OTHER, "task.reward_weights")),
    ("multi_objective_aggregation=sum_then_normalize", eq(LOSS,
        "task.reward_weights",
        "the reward is the weighted sum, then advantages")),
    ("multi_objective_aggregation=normalize_then_sum", no(LOSS,
        "the advantage estimators take one reward per sample; the functions' rewards are summed before "
        "them, not kept apart")),
    ("scale_rewards=group", eq(LOSS,
        "algo.adv_estimator=grpo",
        "std over the group (algo.adv_std_unbiased picks n or n-1; TRL's nanstd is n-1)")),
    ("scale_rewards=none", eq(LOSS, "algo.adv_estimator=drgrpo")),
    ("scale_rewards=batch", no(LOSS,
        "TRL divides by the std of the raw rewards over the batch; the nearest here, "
        "algo.adv_estimator=drgrpo with algo.adv_transforms=[batch_whiten], divides by the std of the "
        "centred advantages: another number")),
    ("loss_type=grpo", eq(LOSS, "algo.loss_agg_mode=seq-mean-token-mean")),
    ("loss_type=dapo", eq(LOSS,
        "algo.loss_agg_mode=token-mean",
        "the denominator is the mini-batch's tokens over all its micro-batches, DAPO's global count")),
    ("loss_type=bnpo", eq(LOSS,
        "algo.loss_agg_mode=token-mean optim.grad_accum=1",
        "bnpo normalises per local batch: one micro-batch per mini-batch")),
    ("loss_type=dr_grpo", eq(LOSS,
        "algo.loss_agg_mode=seq-mean-token-sum-norm algo.loss_token_norm=<max_new_tokens>",
        "TRL's constant is max_completion_length")),
    ("loss_type=cispo", eq(LOSS, "algo.preset=cispo", "algo.policy_loss=cispo with token-mean")),
    ("loss_type=sapo", eq(LOSS,
        "algo.policy_loss=soft_sapo",
        "TRL aggregates it as grpo: seq-mean-token-mean, the default here")),
    ("loss_type=luspo", no(LOSS, "no LUSPO loss; a loss is a function registered with register_policy_loss")),
    ("loss_type=vespo", no(LOSS, "no VESPO loss (see vespo_k_pos)")),
    ("mask_truncated_completions", eq(LOSS, "algo.mask_truncated_completions")),
    ("sync_ref_model", no(LOSS,
        "the reference is the initial policy, never moved (with LoRA: the adapters disabled, so there is "
        "no copy to mix into)")),
    ("ref_model_mixup_alpha", no(LOSS, "no reference sync (see sync_ref_model)")),
    ("ref_model_sync_steps", no(LOSS, "no reference sync (see sync_ref_model)")),
    ("top_entropy_quantile", eq(LOSS, "algo.top_entropy_quantile")),
    ("entropy_coef", eq(LOSS,
        "algo.entropy_coef",
        "aggregated by algo.loss_agg_mode like the policy term (TRL: always the mean per-token entropy)")),
    ("use_adaptive_entropy", no(LOSS,
        "the entropy coefficient is fixed; rollout/entropy_estimate is logged every step to watch for "
        "collapse")),
    ("entropy_coef_min", no(LOSS, "no adaptive entropy control (see use_adaptive_entropy)")),
    ("entropy_coef_max", no(LOSS, "no adaptive entropy control (see use_adaptive_entropy)")),
    ("entropy_coef_delta", no(LOSS, "no adaptive entropy control (see use_adaptive_entropy)")),
    ("entropy_target", no(LOSS, "no adaptive entropy control (see use_adaptive_entropy)")),
    ("max_tool_calling_iterations", no(SAMPLING, "no tool calling: a completion is one assistant turn")),
    ("vllm_importance_sampling_correction=True", eq(CORRECTION,
        "algo.correction_mode=decoupled",
        "dense pi_old recomputed, as TRL; bypass: the sampler's log-probs are pi_old")),
    ("vllm_importance_sampling_correction=False", eq(CORRECTION, "algo.preset=dense",
        "no correction (correction_mode none); its sampler is dense too, as TRL's")),
    ("vllm_importance_sampling_mode=token_truncate", eq(CORRECTION,
        "algo.tis_cap=<clip_max>",
        "token TIS, min(xi, cap); a lower clip (clip_min) has no equivalent")),
    ("vllm_importance_sampling_mode=token_mask", eq(CORRECTION,
        "algo.icepop_low=<clip_min> algo.icepop_high=<clip_max>",
        "IcePop: the weight xi inside the bounds, 0 outside")),
    ("vllm_importance_sampling_mode=sequence_truncate", eq(CORRECTION,
        "algo.seq_tis_cap=<clip_max>",
        "every token weighted by min(prod_t xi_t, cap)")),
    ("vllm_importance_sampling_mode=sequence_mask", eq(CORRECTION,
        "algo.seq_mis_low=<clip_min> algo.seq_mis_high=<clip_max>",
        "Seq-MIS: weight prod_t xi_t, 0 outside the bounds")),
    ("vllm_importance_sampling_clip_max", eq(CORRECTION,
        "algo.tis_cap algo.icepop_high algo.seq_tis_cap algo.seq_mis_high",
        "the upper bound of the mode's rule")),
    ("vllm_importance_sampling_clip_min", eq(CORRECTION,
        "algo.icepop_low algo.seq_mis_low",
        "the mask modes' lower bound")),
    ("off_policy_mask_threshold", eq(CORRECTION, "algo.off_policy_mask_threshold")),
    ("use_bias_correction_kl", eq(LOSS, "algo.kl_estimator=k3_is")),
    ("log_completions", eq(OTHER,
        "logging.completions",
        "rows per step of RUN_DIR/completions.jsonl, also a W&B, MLflow or Trackio table")),
    ("log_multimodal", no(OTHER, "text only")),
    ("num_completions_to_print", eq(OTHER, "logging.print_samples", "printed at each evaluation")),
    ("log_unique_prompts", no(OTHER, "the completions table keeps each sample with its group id")),
    ("log_completions_hub_repo", no(OTHER,
        "the table is written to RUN_DIR/completions.jsonl and the trackers, not pushed to the Hub")),
    ("use_transformers_continuous_batching", eq(OTHER,
        "rollout.batching",
        "continuous batching under rollout.kv_memory_cap")),
    ("transformers_continuous_batching_config", eq(OTHER, "rollout.kv_memory_cap rollout.batching")),
    ("use_transformers_paged", eq(OTHER, "rollout.batching", "deprecated in TRL")),
    ("vllm_importance_sampling_cap", eq(CORRECTION, "algo.tis_cap", "deprecated in TRL: clip_max")),
]
# fmt: on


@dataclass(frozen=True)
class Guide:
    """One user guide: its file, the project's name, and its tables."""

    path: Path
    project: str
    source: str
    keys: list[tuple[str, Row]]
    metrics: list[tuple[str, str, str]]


def config_keys() -> set[str]:
    from sparserl.algo.config import KEY_ALIASES
    from sparserl.config import iter_fields

    return {k for k, _, _ in iter_fields()} | {f"algo.{a}" for a in KEY_ALIASES}


def check_row(name: str, row: Row, keys: set[str]) -> None:
    """Every key in `row.ours` exists; its concrete `key=value` settings load together (placeholders `<...>`
    are checked by key only)."""
    settings = row.ours.split()
    unknown = [s for s in settings if s.split("=", 1)[0] not in keys]
    if unknown:
        raise SystemExit(f"{name}: {unknown} are not config keys")
    concrete = [s for s in settings if "=" in s and "<" not in s]
    if concrete:
        load_config_checked(concrete)


def load_config_checked(settings: list[str]) -> None:
    """The settings load over the default config (a wrong key or value raises ConfigError)."""
    from sparserl.config import load_config

    load_config(None, settings)


def check_metrics(rows: list[tuple[str, str, str]], doc: str) -> None:
    for theirs, ours, _ in rows:
        for name in ours.split():
            if f"`{name}`" not in doc:
                raise SystemExit(f"metric {theirs}: {name} is not documented in docs/metrics.md")


def unmapped(rows: list[tuple[str, Row]]) -> list[str]:
    """Loss, correction and sampling fields with neither an equivalent nor a reason."""
    return [n for n, r in rows if r.kind in (LOSS, CORRECTION, SAMPLING) and not (r.ours or r.why)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _ours(row: Row) -> str:
    if row.why:
        return "not supported"
    return " ".join(f"`{s}`" for s in row.ours.split()) or "-"


def key_table(rows: list[tuple[str, Row]], kinds: tuple[str, ...]) -> list[str]:
    lines = ["| theirs | sparserl | note |", "|---|---|---|"]
    for name, row in rows:
        if row.kind in kinds:
            note = f"why: {row.why}" if row.why else row.note
            lines.append(f"| `{name}` | {_ours(row)} | {_cell(note)} |")
    return lines


def alias_lines(project: str) -> list[str]:
    """The names the config itself accepts from other projects, read from its alias tables."""
    from sparserl.algo.config import KEY_ALIASES
    from sparserl.algo.losses import POLICY_LOSS_ALIASES, REFUSED_POLICY_LOSSES
    from sparserl.algo.rs_aliases import ALIASES, NO_EQUIVALENT

    out = ["## Names the config accepts as they are", ""]
    out += [f"- `algo.{a}` is `algo.{k}` (TRL's name for verl's)" for a, k in KEY_ALIASES.items()]
    out += [f"- `algo.policy_loss={a}` is `{k}`" for a, k in POLICY_LOSS_ALIASES.items()]
    out += [f"- `algo.policy_loss={a}` is refused: {why}" for a, why in REFUSED_POLICY_LOSSES.items()]
    if project == "verl":
        out += [
            f"- `algo.rollout_rs=[{a}:<threshold>]`: verl's `rollout_rs={a}`, an exact rule here"
            for a in ALIASES
        ]
        out += [f"- `rollout_rs={a}` is refused: {why}" for a, why in NO_EQUIVALENT.items()]
    return [*out, ""]


def render(guide: Guide) -> str:
    rows, missing = guide.keys, unmapped(guide.keys)
    head = [
        f"# Coming from {guide.project}",
        "",
        "Generated by `python scripts/user_guides.py` from its tables, checked against the config and "
        "docs/metrics.md (tests/test_user_guides.py keeps this file equal to its output). "
        f"{guide.project}'s names are from {guide.source}.",
        "",
        f"{guide.project}'s GRPO as it is: `sparserl train {PLAIN}` (a dense sampler, no correction); the default "
        "run samples on a sparse KV cache with Sparse-RL's corrections (`algo.preset=sparse-rl`).",
        "",
        "## What sparserl adds",
        "",
        *ADDS,
        "",
        f"## {guide.project}'s config keys",
        "",
    ]
    body: list[str] = []
    for title, kinds in (("Losses and advantages", (LOSS,)), ("Corrections", (CORRECTION,)),
                         ("Sampling", (SAMPLING,)), ("Training and the rest", (TRAINING, OTHER))):  # fmt: skip
        if any(r.kind in kinds for _, r in rows):
            body += [f"### {title}", "", *key_table(rows, kinds), ""]
    metrics = ["## Metrics", "", "| theirs | sparserl | note |", "|---|---|---|"]
    metrics += [
        f"| `{t}` | {' '.join(f'`{o}`' for o in ours.split()) or '-'} | {_cell(n)} |"
        for t, ours, n in guide.metrics
    ]
    tail = [
        "",
        f"Loss, correction and sampling keys with neither an equivalent nor a reason: {len(missing)}.",
        "",
    ]
    return "\n".join([*head, *body, *alias_lines(guide.project), *metrics, *tail])


def guides() -> list[Guide]:
    keys = config_keys()
    doc = (ROOT / "docs" / "metrics.md").read_text()
    out = [
        Guide(ROOT / "docs" / "from_trl.md", "TRL", TRL_SOURCE, TRL_FIELDS + TRL_TRAINING, TRL_METRICS),
        Guide(ROOT / "docs" / "from_verl.md", "verl", VERL_SOURCE, VERL_KEYS, VERL_METRICS),
    ]
    load_config_checked(PLAIN.split())
    for g in out:
        for name, row in g.keys:
            check_row(f"{g.project} {name}", row, keys)
        check_metrics(g.metrics, doc)
    return out


def write_goal(value: int) -> None:
    """The goal's entry in docs/results/ecosystem.json (other goals kept)."""
    path = ROOT / "docs" / "results" / "ecosystem.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("goals", {})[GOAL] = {
        "value": value,
        "target": 0,
        "met": value == 0,
        "command": "python scripts/user_guides.py --check",
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed files; write nothing"
    )
    args = parser.parse_args()
    built = guides()
    value = len(unmapped(TRL_FIELDS))
    drift = [g.path.name for g in built if not g.path.is_file() or g.path.read_text() != render(g)]
    if args.check:
        print(json.dumps({"goal": GOAL, "value": value, "target": 0, "met": value == 0, "drift": drift}))
        return 1 if drift or value else 0
    for g in built:
        g.path.write_text(render(g))
    write_goal(value)
    print(
        f"wrote {', '.join(str(g.path.relative_to(ROOT)) for g in built)}; TRL rows without either: {value}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
