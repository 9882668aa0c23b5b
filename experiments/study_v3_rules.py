"""Study v3, the parts that need no model: the worked answers in their two styles, the restate
regex, the disjoint row sets, and every decision rule fixed before the runs (the budget rule, the warm start's
stop and fallback ladder, the pilot's lr rule, the validity gate, the collapse rule, the paired contrasts with
Holm, the non-inferiority of claim 2 and its seed-paired bootstrap). experiments/study_v3.py writes RULES into
docs/results/study_v3/study_v3.json at its `setup` stage and applies these functions; tests/test_study_v3.py
tests them.
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Sequence

from scipy import stats

# --- the task: arithmetic, '+' only; the fallback ladder's rungs (operands, most digits), tried in order
LADDER = [(12, 2), (12, 1), (8, 2)]
RESTATE_EVERY = 4  # a 'restate' answer lists the operands still to add after every 4 addition lines
RESTATE_SHARE_SFT = 0.3  # SFT mix: 70% running-only, 30% restate
RESTATE_RE = re.compile(r"^Left to add: \d+( \+ \d+)*\s*$", re.MULTILINE)
SYSTEM_PROMPT = (
    "Add the numbers one at a time, one line per addition, keeping a running sum, and put the final result "
    "inside \\boxed{}."
)
# Row sets, disjoint by construction (task seed, split) and checked at setup: SFT, RL training, probe/scoping,
# held out (the first 128 rows, never used for any decision)
ROW_SETS = {
    "sft": {"task_seed": 1, "split": "train"},
    "rl_train": {"task_seed": 0, "split": "train"},
    "probe": {"task_seed": 2, "split": "test"},
    "heldout": {"task_seed": 0, "split": "test", "rows": 128},
}

# --- decision rules, fixed before any run (written into study_v3.json by `setup`)
RULES = {
    "warmstart": {
        "sft": "LoRA r16/alpha32 (all linear layers), AdamW lr 3e-4, 8 worked answers per step (70% running, 30% "
        "restate), probe every 25 steps: 32 probe prompts x 2 samples, temperature 1.0, 320 new tokens",
        "stop": "the first probe with dense reward >= 0.35; cap 200 steps",
        "ladder": "if no probe reaches 0.35 by step 200, the next rung of (12 operands, 2 digits) -> (12, 1) -> "
        "(8, 2) that reaches it with mean completion >= 100 tokens; none: stop, claims not testable",
        "target": 0.35,
        "cap": 200,
        "probe_every": 25,
        "min_mean_tokens": 100,
    },
    "budget": {
        "candidates": "R-KV budgets of max probe prompt + {16, 32, 48, 64, 96, 128}, rounded up to 8; interval "
        "16, window 8, per head (the first cut falls in the answer)",
        "measured_on": "64 probe prompts x 4 samples of the starting model, temperature 1.0, 320 new tokens",
        "rule": "the smallest budget with sparse reward >= 0.75 x dense, and (share of tokens off by > 0.5 >= "
        "3% or k3 >= 0.03), and retained-token saving >= 35%; none: 16 operands and re-scope once; still none: "
        "stop and report the claims untestable at 135M",
        "offsets": [16, 32, 48, 64, 96, 128],
        "reward_ratio_min": 0.75,
        "frac_off_min": 0.03,
        "k3_min": 0.03,
        "saving_min": 0.35,
    },
    "pilot": {
        "rule": "10 rollouts of the dense arm, seed 0, lr 5e-5; halve the lr once if the KL to the reference "
        "(actor/kl_ref) exceeds 0.1 at any step or the reward falls (mean of rollouts 6-10 below 1-5)",
        "lr": 5e-5,
        "kl_max": 0.1,
    },
    "arms": {
        "arms": ["dense", "naive-sparse-rkv", "sparse-rl-rkv"],
        "seeds": [0, 1, 2, 3],
        "design": "4 prompts x 8 samples per rollout, 4 optimizer steps per rollout (mini-batches of 8), LoRA "
        "r16, 40 rollouts = 160 optimizer steps; the arms of a seed back to back, same starting model and "
        "prompt order",
    },
    "evaluation": "128 held-out prompts x 4 samples, dense and R-KV at the training budget and one candidate "
    "tighter; per-prompt rewards stored; each model in its own process",
    "validity_gate": {
        "rule": "dense arm's held-out gain over the starting model >= +0.08 (mean of the seed-paired gains), "
        "and each eviction arm's mean train reward over rollouts 1-10 >= 0.5 x dense's; if not, claims 1-3 "
        "are reported 'not testable' with the reason",
        "dense_gain_min": 0.08,
        "early_reward_ratio_min": 0.5,
    },
    "collapse": {
        "rule": "a run collapsed if its best 10-rollout reward window is >= 0.25 and its last 10 rollouts fall "
        "below half of it, or its truncation share over the last 10 rollouts is >= 25%, or its mean length "
        "over the last 10 rollouts is >= 1.6x that of the first 10",
        "window": 10,
        "floor": 0.25,
        "truncation_max": 0.25,
        "length_ratio_max": 1.6,
    },
    "contrasts": {
        "rule": "paired by seed, one-sided t with 3 degrees of freedom, Holm over claims 1-3 at alpha 0.05; a "
        "'no difference' needs a paired TOST with margin 0.05 (held-out accuracy) at 5%",
        "alpha": 0.05,
        "equivalence_margin": 0.05,
    },
    "claim2": {
        "rule": "gain(Sparse-RL) - 0.75 x gain(dense) > 0 paired by seed (one-sided, in the Holm family) with "
        "retained-KV saving >= 35%; the ratio of mean gains with a seed-paired bootstrap 95% interval "
        "(10000 resamples of the 4 seeds, seed 0)",
        "fraction": 0.75,
        "bootstrap": 10000,
    },
}

GOALS = {
    "validity_gate": "dense gains >= +0.08 held out and the eviction arms' early train reward >= 0.5 x dense's",
    "claim1_sparse_rl_beats_naive": "Sparse-RL minus naive, held-out dense accuracy > 0 (paired, Holm), or naive "
    "collapses on >= 2 of 4 seeds while Sparse-RL collapses on none",
    "claim2_sparse_rl_keeps_dense_gain": "gain(Sparse-RL) - 0.75 x gain(dense) > 0 (one-sided 95%, Holm) with "
    "retained-KV saving >= 35%",
    "claim3_sparse_rl_model_under_rkv": "Sparse-RL minus dense-trained, held out under R-KV at the training "
    "budget, > 0 (paired, Holm)",
}


def operands_of(expression: str) -> list[int]:
    """The operands of a '+'-only expression ('12 + 7 + 45')."""
    return [int(x) for x in expression.split("+")]


def worked_answer(operands: Sequence[int], restate: bool) -> str:
    """The running-sum answer: one line per addition, then the boxed result; with `restate`, after every
    RESTATE_EVERY addition lines (and while some remain) a line listing the operands still to add."""
    lines, total = [], operands[0]
    for k, x in enumerate(operands[1:], start=1):
        lines.append(f"{total} + {x} = {total + x}")
        total += x
        rest = operands[k + 1 :]
        if restate and k % RESTATE_EVERY == 0 and rest:
            lines.append("Left to add: " + " + ".join(map(str, rest)))
    lines.append(f"The result is \\boxed{{{total}}}.")
    return "\n".join(lines)


def sft_style(index: int) -> bool:
    """Whether SFT row `index` gets the restate style: 3 rows in every 10 (the 70/30 mix, exact per 10 rows)."""
    return index % 10 < round(10 * RESTATE_SHARE_SFT)


def restates(text: str) -> bool:
    return RESTATE_RE.search(text) is not None


def restate_share(texts: Sequence[str]) -> float:
    """Share of completions with at least one restate line."""
    return sum(map(restates, texts)) / len(texts) if texts else 0.0


def candidate_budgets(max_prompt: int) -> list[int]:
    return [-(-(max_prompt + o) // 8) * 8 for o in RULES["budget"]["offsets"]]


def retained_saving(prompt_lens: Sequence[int], completion_lens: Sequence[int], bound: int) -> float:
    """1 - positions an evicting cache holds at the end of each sequence (at most `bound`) over those a dense
    cache holds (prompt + completion), summed over the sequences."""
    dense = [p + c for p, c in zip(prompt_lens, completion_lens, strict=True)]
    return 1 - sum(min(bound, d) for d in dense) / sum(dense)


def budget_qualifies(row: dict, dense_reward: float) -> bool:
    r = RULES["budget"]
    return (
        row["reward"] >= r["reward_ratio_min"] * dense_reward
        and (row["frac_off"] >= r["frac_off_min"] or row["kl_k3"] >= r["k3_min"])
        and row["retained_saving"] >= r["saving_min"]
    )


def choose_budget(rows: dict[int, dict], dense_reward: float) -> int | None:
    """The budget rule: the smallest qualifying candidate, or None."""
    ok = [b for b, row in rows.items() if budget_qualifies(row, dense_reward)]
    return min(ok) if ok else None


def sft_done(probe: dict) -> bool:
    w = RULES["warmstart"]
    return probe["dense_reward"] >= w["target"] and probe["mean_length"] >= w["min_mean_tokens"]


def warmstart_goals(state: dict) -> dict:
    """The warm start's goal as measured so far: a probe with dense reward >= the target (and long enough
    answers) on some rung of the ladder, within the step cap."""
    w = RULES["warmstart"]
    probes = [p for rung in state.get("rungs", {}).values() for p in rung["probes"]]
    best = max((p["dense_reward"] for p in probes), default=None)
    return {
        "warm start reaches the start level": {
            "value": best,
            "target": w["target"],
            "met": bool(state.get("done")) and not state.get("failed", False),
            "unit": f"best probe dense reward so far (32 prompts x 2 samples); met when a probe passes sft_done "
            f"(>= {w['target']} with mean completion >= {w['min_mean_tokens']} tokens) within {w['cap']} steps",
            "command": "python experiments/study_v3.py warmstart",
        }
    }


def pilot_lr(kl_ref: Sequence[float], reward: Sequence[float], lr: float) -> tuple[float, str]:
    """The pilot's rule: the lr kept, or halved (once) with the reason."""
    if max(kl_ref, default=0.0) > RULES["pilot"]["kl_max"]:
        return lr / 2, f"KL to the reference reached {max(kl_ref):.3f} > {RULES['pilot']['kl_max']}"
    if len(reward) >= 10 and statistics.fmean(reward[5:10]) < statistics.fmean(reward[:5]):
        return lr / 2, "the reward fell (rollouts 6-10 below 1-5)"
    return lr, "kept"


def collapsed(reward: Sequence[float], length: Sequence[float], truncated: Sequence[float]) -> dict:
    """The collapse rule on one run's per-rollout curves; returns each clause and the verdict."""
    c, w = RULES["collapse"], RULES["collapse"]["window"]
    if len(reward) < 2 * w:
        return {"collapsed": False, "reason": f"fewer than {2 * w} rollouts"}
    windows = [statistics.fmean(reward[i : i + w]) for i in range(len(reward) - w + 1)]
    best, last = max(windows), windows[-1]
    out = {
        "best_window": best,
        "last_window": last,
        "reward_fell": best >= c["floor"] and last < 0.5 * best,
        "truncation_last": statistics.fmean(truncated[-w:]),
        "length_ratio": statistics.fmean(length[-w:]) / max(statistics.fmean(length[:w]), 1e-9),
    }
    out["truncated"] = out["truncation_last"] >= c["truncation_max"]
    out["length_grew"] = out["length_ratio"] >= c["length_ratio_max"]
    out["collapsed"] = out["reward_fell"] or out["truncated"] or out["length_grew"]
    return out


def paired_one_sided(a: Sequence[float], b: Sequence[float]) -> dict:
    """a - b per seed, one-sided paired t (H1: mean > 0), df = seeds - 1."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    mean, se = statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5
    t = mean / se if se > 0 else (float("inf") if mean > 0 else float("-inf") if mean < 0 else 0.0)
    return {
        "per_seed": d,
        "mean": mean,
        "se": se,
        "t": t,
        "df": len(d) - 1,
        "p": float(stats.t.sf(t, len(d) - 1)),
    }


def holm(pvalues: dict[str, float], alpha: float = RULES["contrasts"]["alpha"]) -> dict[str, bool]:
    """Holm's step-down: which hypotheses are rejected at family-wise level `alpha`."""
    order, out, m = sorted(pvalues, key=pvalues.get), {}, len(pvalues)
    stopped = False
    for i, name in enumerate(order):
        stopped = stopped or pvalues[name] > alpha / (m - i)
        out[name] = not stopped
    return out


def equivalent(d: Sequence[float], margin: float = RULES["contrasts"]["equivalence_margin"]) -> dict:
    """Paired TOST: both one-sided tests of |mean d| < margin at 5%."""
    lo = paired_one_sided([x + margin for x in d], [0.0] * len(d))["p"]
    hi = paired_one_sided([margin - x for x in d], [0.0] * len(d))["p"]
    return {"p": max(lo, hi), "equivalent": max(lo, hi) < 0.05, "margin": margin}


def gain_ratio_bootstrap(
    g_sparse: Sequence[float], g_dense: Sequence[float], draws: int, seed: int = 0
) -> dict:
    """Ratio of mean gains with a seed-paired percentile bootstrap 95% interval (resampling seeds)."""
    rng, n, ratios = random.Random(seed), len(g_sparse), []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        den = statistics.fmean(g_dense[i] for i in idx)
        if den != 0:
            ratios.append(statistics.fmean(g_sparse[i] for i in idx) / den)
    ratios.sort()
    ci = [ratios[int(0.025 * len(ratios))], ratios[int(0.975 * len(ratios)) - 1]] if ratios else [None, None]
    return {"ratio": statistics.fmean(g_sparse) / statistics.fmean(g_dense), "ci95": ci, "draws": len(ratios)}


def validity_gate(dense_gains: Sequence[float], early_reward: dict[str, float]) -> dict:
    """The gate before any contrast: dense's mean paired gain, and each eviction arm's early train reward
    against dense's (`early_reward`: arm -> mean train reward over rollouts 1-10, seeds averaged)."""
    g = RULES["validity_gate"]
    gain = statistics.fmean(dense_gains)
    ratios = {a: r / max(early_reward["dense"], 1e-9) for a, r in early_reward.items() if a != "dense"}
    reasons = [f"dense gained {gain:+.3f} < +{g['dense_gain_min']}"] if gain < g["dense_gain_min"] else []
    reasons += [
        f"{a}: early reward {r:.2f} x dense's" for a, r in ratios.items() if r < g["early_reward_ratio_min"]
    ]
    return {"dense_gain": gain, "early_reward_ratio": ratios, "passed": not reasons, "reasons": reasons}
