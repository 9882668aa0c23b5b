"""Study v2's recall check: why do the eviction arms learn nothing? The warm-started model restates the queried
values before it adds them (`alpha = 9 and uniform = 0, so ...`), so each sample shows whether it still had the
values: every one restated right ("recalled"), any restated wrong ("misrecalled"), or some not restated and none
wrong ("unstated"). The starting model samples the same held-out prompts densely and under R-KV at the scoped
budget (the same seeds, through `sparserl.eval.evaluate`); if eviction loses the values, R-KV's failures are
misrecalls while its accuracy given a right recall stays near dense's.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from sparserl.tasks import Example, Task

CLASSES = ("recalled", "misrecalled", "unstated")
AFTER_OPERAND = (
    r"(?<!\w[-+*/])(?<!\w [-+*/])(?<!\w[-+*/] )(?<!\w [-+*/] )"  # `9 + name`, not a bullet `- name`
)
EXAMPLES_KEPT = 3  # completions kept per mode and class, so that the classification can be checked by eye


def recall_class(text: str, facts: dict[str, int]) -> str:
    """How a completion restates the queried values `facts` (name -> value). A restatement is `name = number`
    (any case) that is not an operand of a sum on its line (`uniform + alpha = 0 + 9` restates nothing, a bullet
    `- alpha = 9` does); the first one per name counts. Known miss: `alpha plus uniform = 9` reads as a
    restatement of uniform."""
    stated = {}
    for name in facts:
        pattern = rf"{AFTER_OPERAND}\b{re.escape(name)}[ \t]*=[ \t]*(-?\d+)\b(?![ \t]*[-+*/][ \t]*\w)"
        m = re.search(pattern, text, flags=re.IGNORECASE)
        if m:
            stated[name] = int(m.group(1))
    if any(v != facts[n] for n, v in stated.items()):
        return "misrecalled"
    return "recalled" if len(stated) == len(facts) else "unstated"


def recall_table(samples: list[tuple[str, float, str]]) -> dict[str, Any]:
    """Share of each class, the mean reward within it and a few of its completions, from (class, reward, text)."""
    out: dict[str, Any] = {
        "samples": len(samples),
        "accuracy": sum(r for _, r, _ in samples) / max(len(samples), 1),
    }
    for c in CLASSES:
        rows = [(r, t) for k, r, t in samples if k == c]
        out[c] = {"share": len(rows) / max(len(samples), 1),
                  "accuracy": sum(r for r, _ in rows) / len(rows) if rows else None,
                  "examples": [t for _, t in rows[:EXAMPLES_KEPT]]}  # fmt: skip
    return out


def recall(model_spec: str, task: Any, kv: Any, prompts: int, samples: int, rollout: Any, seed: int) -> dict:
    """The recall table of `model_spec` on the first `prompts` rows of `task`, `samples` each, dense and under
    `kv` (a KVConfig), sampled as the setting's rollouts are (`rollout`: temperature, top_p, max_new_tokens)."""
    from sparserl.eval.evaluate import evaluate
    from sparserl.models import load_model

    model, tok = load_model(model_spec)
    sampling = {
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "max_new_tokens": rollout.max_new_tokens,
    }
    ev = evaluate(
        model, tok, task, kv=kv, samples=samples, limit=prompts, seed=seed, details=True, **sampling
    )
    out = {"model": model_spec, "prompts": prompts, "samples": samples, "seed": seed, **sampling,
           "kv": {"method": kv.method, "budget": kv.budget, "interval": kv.interval, "window": kv.window}}  # fmt: skip
    for mode, name in (("dense", "dense"), ("sparse", kv.method)):
        rows = [
            (recall_class(text, task[ex["index"]].meta["facts"]), reward, text)
            for ex in ev["examples"]
            for text, reward in zip(ex[mode]["completions"], ex[mode]["rewards"], strict=True)
        ]
        out[name] = recall_table(rows)
        print(name, {c: round(out[name][c]["share"], 3) for c in CLASSES}, flush=True)
    return out


class StepPrompts(Task):
    """The rows one seed's training steps draw, in the order drawn, scored by the task's own reward: a view that
    `sparserl.eval.evaluate` can sample and score like any task."""

    def __init__(self, task: Task, order: list[int]) -> None:
        self.task, self.order = task, order
        self.name, self.self_guarded, self.reward_timeout = task.name, task.self_guarded, task.reward_timeout

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> Example:
        return self.task[self.order[i]]

    def reward(self, completion_text: str, example: Example) -> float:
        return self.task.reward(completion_text, example)


def step_prompts_reward(model_spec: str, task: Task, kv: Any, seeds: list[int], steps: int, per_step: int,
                        samples: int, rollout: Any) -> dict:  # fmt: skip
    """The starting model's reward under `kv` on each training step's prompts, per seed: the trainer draws
    them in a seeded order (sparserl.seeds.PromptSampler), the same for every arm of a seed, so a fall
    in an arm's reward that this curve shares comes from its prompts, not from its training."""
    from sparserl.eval.evaluate import evaluate
    from sparserl.models import load_model
    from sparserl.seeds import PromptSampler

    model, tok = load_model(model_spec)
    out: dict[str, Any] = {"model": model_spec, "samples": samples}
    for seed in seeds:
        view = StepPrompts(task, PromptSampler(len(task), seed).take(steps * per_step))
        ev = evaluate(model, tok, view, kv=kv, samples=samples, seed=1234, dense=False, details=True,
                      max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p)  # fmt: skip
        out |= {"kv": ev["kv"], "sampling": ev["sampling"]}
        per_prompt = [statistics.fmean(ex["sparse"]["rewards"]) for ex in ev["examples"]]
        out[str(seed)] = [
            statistics.fmean(per_prompt[s : s + per_step]) for s in range(0, len(view), per_step)
        ]
        print(seed, [round(r, 2) for r in out[str(seed)]], flush=True)
    return out
