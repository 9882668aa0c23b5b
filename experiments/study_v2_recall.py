"""Study v2's recall check: why do the eviction arms learn nothing? The warm-started model restates the queried
values before it adds them (`alpha = 9 and uniform = 0, so ...`), so each sample shows whether it still had the
values: restated right ("recalled"), restated wrong ("misrecalled"), or not restated at all ("unstated"). The
starting model samples the same held-out prompts densely and under R-KV at the scoped budget, at the training
temperature; if eviction loses the values, R-KV's failures are misrecalls while its accuracy given a right recall
stays near dense's.
"""

from __future__ import annotations

import re
from typing import Any

CLASSES = ("recalled", "misrecalled", "unstated")


def recall_class(text: str, facts: dict[str, int]) -> str:
    """How a completion restates the queried values `facts` (name -> value). A restatement is `name = number`
    not inside an expression (`uniform + alpha = 0 + 9` restates nothing); the first one per name counts."""
    stated = {}
    for name in facts:
        m = re.search(rf"(?<![-+*/]\s)(?<![-+*/])\b{re.escape(name)}\s*=\s*(-?\d+)\b(?!\s*[-+*/])", text)
        if m:
            stated[name] = int(m.group(1))
    if any(v != facts[n] for n, v in stated.items()):
        return "misrecalled"
    return "recalled" if len(stated) == len(facts) else "unstated"


def recall_table(samples: list[tuple[str, float]]) -> dict[str, Any]:
    """Share of each class and the mean reward within it, from (class, reward) pairs."""
    out: dict[str, Any] = {
        "samples": len(samples),
        "accuracy": sum(r for _, r in samples) / max(len(samples), 1),
    }
    for c in CLASSES:
        rewards = [r for k, r in samples if k == c]
        out[c] = {"share": len(rewards) / max(len(samples), 1),
                  "accuracy": sum(rewards) / len(rewards) if rewards else None}  # fmt: skip
    return out


def recall(model_spec: str, task: Any, kv_modes: dict[str, Any], prompts: int, n: int, rollout: Any) -> dict:
    """The recall table of `model_spec` on the first `prompts` rows of `task`, n samples each, per KV mode
    (name -> KVConfig, or None for dense), at the setting's sampling parameters `rollout`; same seed per mode."""
    from sparserl.engine import RolloutEngine
    from sparserl.models import encode_prompt, load_model

    model, tok = load_model(model_spec)
    examples = [task[i] for i in range(prompts)]
    ids = [encode_prompt(tok, ex.messages) for ex in examples]
    out = {"model": model_spec, "prompts": prompts, "n": n, "temperature": rollout.temperature}
    for mode, kv in kv_modes.items():
        gen = RolloutEngine(model, tok, kv).generate(ids, n=n, max_new_tokens=rollout.max_new_tokens,
                                                     temperature=rollout.temperature, top_p=rollout.top_p, seed=1234)  # fmt: skip
        pairs = []
        for s in gen.samples:
            ex = examples[s.prompt_index]
            text = tok.decode(s.completion_ids, skip_special_tokens=True)
            pairs.append((recall_class(text, ex.meta["facts"]), task.score(text, ex)))
        out[mode] = recall_table(pairs)
        print(mode, out[mode], flush=True)
    return out
