"""The task interface: an `Example` is one prompt with its reference answer; a `Task` is a sequence of them
plus the reward of a completion. Tasks are registered by name (sparserl/tasks/registry.py) so configs can pick
them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from sparserl.tasks.rewards import RewardStats, safe_call


@dataclass
class Example:
    """One prompt: chat `messages` ending with the \\boxed{} instruction, the reference `answer`, `meta`
    (provenance such as source file and line, or the generator's parameters) and, for data files, the
    source `row` as read (its fields go to users' reward functions)."""

    messages: list[dict]
    answer: str
    meta: dict = field(default_factory=dict)
    row: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        """Where the example comes from ('file.jsonl:LINE', 'name[split] row N'); '' for generated ones."""
        return str(self.meta.get("source", ""))


class Task:
    """A sequence of examples and the reward of a completion. Subclasses implement `__len__`, `__getitem__`
    and `reward`; `score` wraps `reward` so that errors and hangs score 0 and are counted in `stats`.

    `self_guarded = True` says `reward` bounds its own time (the built-in tasks do: math-verify runs in a
    killable worker); otherwise `score` runs it in a thread and gives up after `reward_timeout` seconds."""

    name: str = "task"
    reward_timeout: float = 5.0
    self_guarded: bool = False

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> Example:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Example]:
        return (self[i] for i in range(len(self)))

    def reward(self, completion_text: str, example: Example) -> float:
        """Reward of one completion, in [0, 1]."""
        raise NotImplementedError

    @property
    def stats(self) -> RewardStats:
        """Failure counters of `score` (the trainer logs `stats.as_metrics()`)."""
        if "_stats" not in self.__dict__:
            self.__dict__["_stats"] = RewardStats()
        return self.__dict__["_stats"]

    def warmup(self) -> None:
        """Prepare what `reward` needs (e.g. start a worker) outside the timed call; called by `score`."""

    def score(self, completion_text: str, example: Example) -> float:
        """`reward`, or 0.0 (counted in `stats`) when it raises, returns NaN/inf or overruns."""
        self.warmup()
        timeout = None if self.self_guarded else self.reward_timeout
        return safe_call(self.reward, completion_text, example, timeout=timeout, stats=self.stats)

    def score_batch(self, completions: list[str], examples: list[Example]) -> list[float]:
        """`score` of each (completion, example) pair."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        return [self.score(c, e) for c, e in zip(completions, examples, strict=True)]
