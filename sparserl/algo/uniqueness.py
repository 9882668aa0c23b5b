"""Uniqueness-aware advantages ("Rewarding the Rare", arXiv 2601.08763), as an advantage transform.

Within each group (one prompt's rollouts), a judge clusters the correct rollouts (task reward > 0, before the
overlong penalty) by solution strategy; a correct rollout i is weighted w_i = |C(i)|^-alpha, |C(i)| the size of
its cluster among the group's correct rollouts, and a wrong one keeps w_i = 1. `shaping.mode=advantage`
multiplies the advantages by w (token-level rows as wholes); `shaping.mode=reward` multiplies the rewards by w
and recomputes the advantages. docs/uniqueness.md has the formula, the judges and what is the paper's and what is ours.

Here are the pure parts and the rule judge; the judges that run the policy model (`embedding`, `llm`) live in
sparserl/trainer/judges.py and join `JUDGES` when that module is imported (the trainer imports it).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from sparserl.algo.advantages import (
    ADV_TRANSFORMS,
    AdvantageTransform,
    TransformContext,
    advantages,
    register_adv_transform,
    transform_extras,
)
from sparserl.errors import UserError
from sparserl.registry import Registry
from sparserl.tasks.answers import extract_boxed

# Judges that run the policy model: registered by sparserl.trainer.judges (algo never imports the trainer).
MODEL_JUDGES = ("embedding", "llm")
MODES = ("advantage", "reward")


# ---- judges ------------------------------------------------------------------------------------------------


class Judge:
    """Clusters one group's correct rollouts by solution strategy: `cluster(texts)` -> one integer label per
    text (equal labels: same strategy). Built once per run with the transform's context; `failures` counts
    calls whose answer could not be used (each then labelled all-singletons: no reweighting)."""

    name: ClassVar[str] = ""

    def __init__(self, ctx: TransformContext) -> None:
        self.ctx = ctx
        self.failures = 0

    def cluster(self, texts: list[str]) -> list[int]:
        raise NotImplementedError


JUDGES: Registry[type[Judge]] = Registry("shaping.judge")
register_judge = JUDGES.register  # class decorator: `shaping.judge=name`


def known_judges() -> list[str]:
    """Every judge name `shaping.judge` may take: those registered, and the model-backed ones that
    sparserl.trainer.judges registers when imported."""
    return list(dict.fromkeys([*JUDGES, *MODEL_JUDGES]))


def make_judge(name: str, ctx: TransformContext) -> Judge:
    """The judge registered as `name`, built with `ctx`; a model-backed judge whose module was not imported
    is an error saying which import registers it."""
    if name not in JUDGES and name in MODEL_JUDGES:
        raise UserError(
            f"shaping.judge={name!r} runs the policy model and is registered by sparserl.trainer.judges: "
            "import that module first (the trainer does; run through `sparserl train` or Trainer)"
        )
    return JUDGES.lookup(name)(ctx)


def first_seen_labels(keys: Sequence[object]) -> list[int]:
    """0, 1, 2, ... in order of first appearance: equal keys share a label."""
    seen: dict[object, int] = {}
    return [seen.setdefault(k, len(seen)) for k in keys]


# ---- the rule judge: an arithmetic skeleton --------------------------------------------------------------

_SYMBOLS = (
    ("\\times", "*"), ("\\cdot", "*"), ("\u00d7", "*"), ("\u00b7", "*"), ("\u2217", "*"),
    ("\\div", "/"), ("\u00f7", "/"), ("\u2212", "-"), ("\u2013", "-"), ("\\left", ""), ("\\right", ""),
)  # fmt: skip
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TIMES_X = re.compile(r"(?<=[\d)])\s*[xX]\s*(?=[\d(])")
_WORD_HYPHEN = re.compile(r"(?<=[A-Za-z])-|-(?=[A-Za-z])")  # 5-year-old, twenty-one
_STEP_BREAK = re.compile(r"[\n,;:!?]|\.(?!\d)|(?<!\d)\.")  # a period inside a decimal number is no break
_TOKEN = re.compile(r"\d+(?:\.\d+)?|[-+*/^=()]")
_BINARY = re.compile(r"[N)][-+*/^=]")  # an operator with an operand on its left
_NUMBER_PAIR = re.compile(r"(?<=N)(?=N)")  # between two numbers with no operator between them


def _normalise_symbols(text: str) -> str:
    """LaTeX and Unicode operators as ASCII, \\frac{a}{b} as (a)/(b), 1,200 as 1200, 3 x 4 as 3*4, no
    hyphens joining words (5-year-old is no subtraction)."""
    for symbol, ascii_op in _SYMBOLS:
        text = text.replace(symbol, ascii_op)
    for _ in range(8):  # nested fractions, innermost first
        text, count = _FRAC.subn(r"(\1)/(\2)", text)
        if not count:
            break
    return _WORD_HYPHEN.sub(" ", _TIMES_X.sub("*", _THOUSANDS.sub("", text)))


def _pattern(chunk: str) -> str:
    """Numbers as N, operators and parentheses in order, everything else (words, spaces) dropped."""
    return "".join("N" if t[0].isdigit() else t for t in _TOKEN.findall(chunk))


def _clean_step(step: str) -> str:
    """A step's pattern without dangling operators at its ends or empty parentheses; '' when it is no
    computation (no operator with a left operand: a lone number, a list index, a hyphenated word)."""
    step = step.lstrip("+*/^=").rstrip("+-*/^=")
    while "()" in step:
        step = step.replace("()", "")
    return step if "N" in step and _BINARY.search(step) else ""


def _chunk_steps(chunk: str) -> list[str]:
    """The computation steps of one chunk, e.g. ['N*N=N', 'N*N=N'] for '3 * 2 = 6 and 4 * 2 = 8': a number
    right after a number (only words between) starts a new step."""
    return [s for s in map(_clean_step, _NUMBER_PAIR.split(_pattern(chunk))) if s]


def arithmetic_skeleton(text: str) -> str:
    """The strategy key of the rule judge: the text's computation steps (split at line breaks, punctuation
    and between two numbers with only words between) as operator patterns in order, then the normalised
    \\boxed{} answer. '12 + 7 = 19, then 19 * 2 = 38: \\boxed{38}' -> 'N+N=N;N*N=N|N'."""
    steps = [s for chunk in _STEP_BREAK.split(_normalise_symbols(text)) for s in _chunk_steps(chunk)]
    boxed = extract_boxed(text)
    answer = _pattern(_normalise_symbols(boxed)) if boxed is not None else ""
    return ";".join(steps) + "|" + answer


@register_judge("rule")
class RuleJudge(Judge):
    """Deterministic: two texts share a strategy when their arithmetic skeletons (`arithmetic_skeleton`) are
    equal, i.e. they do the same operations in the same order, whatever the numbers and wording."""

    def cluster(self, texts: list[str]) -> list[int]:
        return first_seen_labels([arithmetic_skeleton(t) for t in texts])


# ---- pure parts ----------------------------------------------------------------------------------------------


def agglomerative_labels(distances: Tensor, threshold: float) -> list[int]:
    """Average-linkage agglomerative clustering of a symmetric [n, n] distance matrix: merge the two closest
    clusters (mean pairwise distance; ties: the first pair) while that distance is <= `threshold`. Labels in
    order of first appearance."""
    n = distances.shape[0]
    d = distances.detach().double().cpu().clone()
    d.fill_diagonal_(float("inf"))
    size = [1] * n
    owner = list(range(n))
    for _ in range(n - 1):
        flat = int(torch.argmin(d))
        a, b = sorted(divmod(flat, n))
        if not d[a, b] <= threshold:
            break
        d[a] = (size[a] * d[a] + size[b] * d[b]) / (size[a] + size[b])  # Lance-Williams, average linkage
        d[:, a] = d[a]
        d[a, a] = d[b] = d[:, b] = float("inf")
        size[a] += size[b]
        owner = [a if o == b else o for o in owner]
    return first_seen_labels(owner)


def uniqueness_weights(labels: Sequence[int | None], group_index: Sequence[int], alpha: float) -> Tensor:
    """w_i = |C(i)|^-alpha for a correct rollout (labels[i] its cluster within its group), 1 for a wrong one
    (labels[i] None); |C(i)| counts the rollouts of i's group with i's label. Float64 [B]; alpha=0 gives
    exactly 1 everywhere."""
    keys = [None if lab is None else (g, lab) for g, lab in zip(group_index, labels, strict=True)]
    sizes = Counter(k for k in keys if k is not None)
    return torch.tensor([1.0 if k is None else float(sizes[k]) ** -alpha for k in keys], dtype=torch.float64)


def cluster_groups(
    judge: Judge, correct: Sequence[bool], group_index: Sequence[int], texts: Sequence[str]
) -> list[int | None]:
    """Per rollout, its cluster label within its group (None for a wrong one): one `judge.cluster` call per
    group with >= 2 correct rollouts (a lone correct rollout is its own cluster, no call)."""
    rows_by_group: dict[int, list[int]] = defaultdict(list)
    for i, (g, ok) in enumerate(zip(group_index, correct, strict=True)):
        if ok:
            rows_by_group[g].append(i)
    labels: list[int | None] = [None] * len(correct)
    for rows in rows_by_group.values():
        got = [0] if len(rows) == 1 else list(judge.cluster([texts[i] for i in rows]))
        if len(got) != len(rows):
            raise ValueError(f"judge {judge.name!r} returned {len(got)} labels for {len(rows)} texts")
        for i, lab in zip(rows, got, strict=True):
            labels[i] = int(lab)
    return labels


def scale_rows(adv: Tensor, w: Tensor) -> Tensor:
    """adv [B] or [B, T] with row i multiplied by w[i], computed in float64, returned in adv's dtype."""
    shape = (-1,) + (1,) * (adv.dim() - 1)
    return (adv.double() * w.to(adv.device).view(shape)).to(adv.dtype)


# ---- the transform ---------------------------------------------------------------------------------------------


@register_adv_transform("uniqueness")
class Uniqueness(AdvantageTransform):
    """Weights correct rollouts by the rarity of their strategy within their group (module docstring). Reads
    `shaping.alpha`, `.mode`, `.judge` (and the judge's own options); `metrics()`: clusters_per_group,
    adv_scale_min, adv_scale_max (the last batch), judge_failures (cumulative)."""

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__(ctx)
        shaping = ctx.shaping
        if shaping is None:
            raise ValueError("the uniqueness transform reads its options from TransformContext.shaping")
        if shaping.mode not in MODES:
            raise ValueError(f"shaping.mode={shaping.mode!r}: choose one of {', '.join(MODES)}")
        self.alpha = float(shaping.alpha)
        self.mode = shaping.mode
        self.judge = make_judge(shaping.judge, ctx)
        self.chain = self._reward_chain() if self.mode == "reward" else []
        self.last = {"clusters_per_group": 0.0, "adv_scale_min": 1.0, "adv_scale_max": 1.0}

    def _reward_chain(self) -> list[AdvantageTransform]:
        """mode=reward recomputes the advantages from the shaped rewards: the estimator, then algo's own
        transforms again (instances of their own)."""
        names = list(self.ctx.algo.adv_transforms)
        if self.name in names:
            raise UserError(
                f"shaping.mode=reward cannot re-run algo.adv_transforms={names}: it holds {self.name!r}"
            )
        return [ADV_TRANSFORMS.lookup(n)(self.ctx) for n in names]

    needs_tokens = True  # mode=reward re-runs the chain, whose members (the tree transform) may need them
    needs_task_rewards = True  # "correct" is the task's verdict, not the reward after the overlong penalty

    def __call__(
        self,
        adv: Tensor,
        rewards: Tensor,
        group_index: Tensor,
        texts: list[str],
        tokens: list | None = None,
        task_rewards: Tensor | None = None,
    ) -> Tensor:
        if len(texts) != rewards.numel() or adv.shape[0] != rewards.numel():
            raise ValueError(
                f"uniqueness needs one completion text and one advantage row per reward: {len(texts)} texts, "
                f"{adv.shape[0]} advantage rows, {rewards.numel()} rewards"
            )
        index = torch.as_tensor(group_index, dtype=torch.long).cpu()
        correct = ((rewards if task_rewards is None else task_rewards).detach().cpu() > 0).tolist()
        labels = cluster_groups(self.judge, correct, index.tolist(), texts)
        w = uniqueness_weights(labels, index.tolist(), self.alpha)
        self._record(labels, index.tolist(), w, correct)
        if bool((w == 1).all()):
            return adv  # nothing reweighted (alpha=0, or every strategy unique): the input, bit for bit
        if self.mode == "advantage":
            return scale_rows(adv, w)
        return self._recompute(adv, rewards, index, texts, w, tokens, task_rewards)

    def _recompute(
        self,
        adv: Tensor,
        rewards: Tensor,
        index: Tensor,
        texts: list[str],
        w: Tensor,
        tokens: list | None,
        task_rewards: Tensor | None,
    ) -> Tensor:
        """mode=reward: r' = w * r, then the run's estimator and algo.adv_transforms on r'."""
        algo = self.ctx.algo
        shaped = rewards.detach().double() * w.to(rewards.device)
        new = advantages(shaped, index, algo.adv_estimator, algo.adv_eps, algo.adv_std_unbiased)
        for transform in self.chain:
            extra = transform_extras(transform, tokens, rewards if task_rewards is None else task_rewards)
            new = transform(new, shaped, index, texts, **extra)
        if new.shape != adv.shape:
            raise ValueError(
                f"shaping.mode=reward recomputed advantages of shape {tuple(new.shape)} but got "
                f"{tuple(adv.shape)}: token-level advantages must come from algo.adv_transforms, which it re-runs"
            )
        return new.to(device=adv.device, dtype=adv.dtype)

    def _record(self, labels: list[int | None], index: list[int], w: Tensor, correct: list[bool]) -> None:
        """The last batch's metrics: mean clusters over groups with a correct rollout, range of w over the
        correct rollouts (1, 1 and 0 clusters when none is correct)."""
        clusters: dict[int, set[int]] = defaultdict(set)
        for g, lab in zip(index, labels, strict=True):
            if lab is not None:
                clusters[g].add(lab)
        w_correct = w[torch.tensor(correct, dtype=torch.bool)]
        self.last = {
            "clusters_per_group": sum(map(len, clusters.values())) / len(clusters) if clusters else 0.0,
            "adv_scale_min": float(w_correct.min()) if w_correct.numel() else 1.0,
            "adv_scale_max": float(w_correct.max()) if w_correct.numel() else 1.0,
        }

    def metrics(self) -> dict[str, float]:
        """The last batch's cluster and weight statistics, the judge's cumulative failures (unprefixed)."""
        return {**self.last, "judge_failures": float(self.judge.failures)}
