"""Training-time held-out evaluation: one sample on each held-out prompt at a fixed seed (comparable over the
run and across arms), with a dense cache and, when trainer.eval_sparse is on, with the training KV policy."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sparserl.engine import RolloutEngine
from sparserl.engine.kv_config import DENSE
from sparserl.engine.scored import generate_and_score
from sparserl.rollout import TaskView
from sparserl.seeds import EVAL, derive_seed


class HeldOutEval:
    """`__call__()` -> eval/<dense|sparse>/reward and /length, time/eval_<mode>, eval/reward_fn/<name> (what
    reward functions logged); the dense pass's samples are kept for `print_samples`."""

    def __init__(
        self, cfg: Any, view: TaskView, rows: list[int], engines: dict[str, Any], module: Any
    ) -> None:
        """`engines`: mode name -> engine ('dense', and 'sparse' when it is evaluated too)."""
        self.cfg, self.view, self.rows, self.engines, self.module = cfg, view, rows, engines, module
        self.samples: list[tuple[str, Any, float]] = []  # (text, example, reward) of the last dense pass

    def __call__(self) -> dict[str, float]:
        r, t = self.cfg.rollout, self.cfg.trainer
        sampling = {"max_new_tokens": r.max_new_tokens, "temperature": t.eval_temperature, "top_p": r.top_p,
                    "top_k": r.top_k, "stop": list(r.stop) or None}  # fmt: skip
        prompt_ids = [self.view.prompt_ids(i) for i in self.rows]
        self.module.eval()
        out: dict[str, float] = {}
        for mode, engine in self.engines.items():
            t0 = time.perf_counter()
            got = generate_and_score(
                engine, self.view.tokenizer, self.view.task, self.rows, prompt_ids, sampling,
                derive_seed(t.seed, EVAL), self.view.rewards, sample_keys=list(self.rows),
            )  # fmt: skip
            if mode == DENSE:
                self.samples = list(zip(got.texts, got.examples, got.rewards.tolist(), strict=True))
            out[f"eval/{mode}/reward"] = got.rewards.mean().item()
            out[f"eval/{mode}/length"] = sum(got.lengths) / max(1, len(got.lengths))
            out[f"time/eval_{mode}"] = time.perf_counter() - t0
        out.update({f"eval/{k}": v for k, v in self.view.drain_logged().items()})  # eval/reward_fn/*
        return out

    def print_samples(self, progress: Any, when: str) -> None:
        """logging.print_samples dense samples (question, answer, reward) of the prompts around the median
        prompt length: a representative problem rather than the first row, the same prompts before and after
        training (ties go to the earlier row)."""
        k = self.cfg.logging.print_samples
        order = sorted(range(len(self.samples)), key=lambda i: (len(self.view.prompt_ids(self.rows[i])), i))
        start = max(0, (len(order) - k) // 2)
        for i in sorted(order[start : start + k]):
            text, ex, r = self.samples[i]
            question = ex.messages[-1]["content"] if ex.messages else ""
            progress.print(
                f"[dim]eval sample {when}[/dim] (reward {r:.2f}, answer {ex.answer!r})\n"
                f"[cyan]Q:[/cyan] {question[:300]}\n[green]A:[/green] {text[:500]}",
                highlight=False,
                markup=True,
            )


def held_out_eval(
    cfg: Any, view: TaskView | None, usable_rows: Any, engine: Callable[[], Any], policy: Any
) -> HeldOutEval | None:
    """The run's held-out evaluation (None without held-out prompts): a dense engine over the policy's modules
    (the trainer's `engine()`, with the run's settings, when the run is dense), and the training KV policy too
    with trainer.eval_sparse; `usable_rows(view, want)` picks the first rows that fit the model."""
    if view is None or cfg.trainer.eval_prompts == 0:
        return None
    dense = (
        RolloutEngine(policy.module, policy.tokenizer, dtype=policy.compute_dtype) if cfg.sparse else engine()
    )
    engines = {DENSE: dense, **({"sparse": engine()} if cfg.trainer.eval_sparse and cfg.sparse else {})}
    return HeldOutEval(cfg, view, usable_rows(view, cfg.trainer.eval_prompts), engines, policy.module)
