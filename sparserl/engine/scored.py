"""Sample a task's prompts with an engine and score the completions with a reward: the loop that training-time
evaluation (`Trainer.evaluate`) and `sparserl eval` (`eval.evaluate`) share. It knows the task only as
`task[row]` (an example to score against), so it sits in the engine, below the trainer and eval alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from sparserl.engine.rollout import RolloutEngine, Sample
    from sparserl.tasks import Example, Task

RewardFn = Callable[[list[str], list["Example"]], "Sequence[float] | Tensor"]


@dataclass
class Scored:
    """Per sample, in the engine's order (the n samples of prompt i contiguous): the sample, its completion
    text, the example it answers, its length in tokens; its reward (as the reward function returned them),
    the engine's run statistics and the seconds spent decoding and scoring."""

    samples: list[Sample]
    texts: list[str]
    examples: list[Example]
    rewards: Sequence[float] | Tensor
    lengths: list[int]
    stats: dict[str, float]
    score_s: float


def generate_and_score(
    engine: RolloutEngine,
    tokenizer: Any,
    task: Task,
    rows: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    sampling: Mapping[str, Any],
    seed: int,
    reward: RewardFn,
    n: int = 1,
    sample_keys: Sequence[int] | None = None,
) -> Scored:
    """`n` samples of each prompt (`prompt_ids[i]` is task row `rows[i]`'s) drawn by `engine.generate` with
    the `sampling` keywords (max_new_tokens, temperature, top_p, top_k, stop), `seed` and `sample_keys`,
    decoded by `tokenizer`, and scored by `reward(texts, examples)` (say, `task.score_batch`)."""
    out = engine.generate(prompt_ids, n=n, seed=seed, sample_keys=sample_keys, **sampling)
    t0 = time.perf_counter()
    samples = list(out.samples)
    texts = tokenizer.batch_decode([list(s.completion_ids) for s in samples], skip_special_tokens=True)
    prompt_examples = [task[row] for row in rows]
    examples = [prompt_examples[s.prompt_index] for s in samples]
    rewards = reward(texts, examples)
    lengths = [len(s.completion_ids) for s in samples]
    return Scored(samples, texts, examples, rewards, lengths, out.stats, time.perf_counter() - t0)
