"""Evaluation under dense and sparse inference (`sparserl eval`) and the rollout demo (`sparserl rollout`)."""

from __future__ import annotations

from sparserl.eval.evaluate import EVAL_TEMPERATURE, EVAL_TOP_P, ExamplesTask, evaluate, write_json
from sparserl.eval.loading import LoadedModel, eval_task_config, load_eval_model, load_eval_task
from sparserl.eval.metrics import pass_at_k, pass_ks, summarize_rewards

__all__ = [
    "EVAL_TEMPERATURE",
    "EVAL_TOP_P",
    "ExamplesTask",
    "LoadedModel",
    "eval_task_config",
    "evaluate",
    "load_eval_model",
    "load_eval_task",
    "pass_at_k",
    "pass_ks",
    "summarize_rewards",
    "write_json",
]
