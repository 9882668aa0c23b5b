"""Study v4, the parts that need no model: the samplers of the dial, the estimators, and every decision
rule fixed before stage A1 runs (R1 eligibility, R2 the mechanism verdict, R3 the instrument check, R4 the
training gate, R5 training, R6 the diagnostics, and the validity gate). experiments/study_v4.py writes RULES into
docs/results/study_v4/study_v4.json at its `setup` stage; `sparserl bias` (sparserl/eval/bias*.py) measures what
the rules read, and the functions below judge them.
"""

from __future__ import annotations

# The dial (stage A1): each sampler as `sparserl bias` overrides of experiments/study_v4.yaml. The dense twin of
# every sample is the same config's dense sampler at rollout.temperature (1.0), coupled by its random stream.
SAMPLERS: dict[str, list[str]] = {
    "dense": ["kv.method=dense", "algo.sparse_rollout=false"],
    **{f"rkv{b}": ["kv.method=rkv", f"kv.budget={b}"] for b in (104, 112, 120, 128, 136)},
    **{f"block_topk{b}": ["kv.method=block_topk", f"kv.budget={b}"] for b in (48, 64, 80)},
    "streaming128": ["kv.method=streaming_llm", "kv.budget=128"],
    "random128": ["kv.method=random", "kv.budget=128"],
    "temp1.15": ["kv.method=dense", "algo.sparse_rollout=false", "rollout.sampler_temperature=1.15"],
    "temp1.3": ["kv.method=dense", "algo.sparse_rollout=false", "rollout.sampler_temperature=1.3"],
}
CONTROLS = ("temp1.15", "temp1.3")  # the positive control: a sampler that differs from pi_old by construction
EVICTING = tuple(k for k in SAMPLERS if k.startswith(("rkv", "streaming", "random")))

RULES = {
    "setting": "SmolLM2-135M after study v3's 12x1 LoRA SFT warm start, reproduced (weights' sha256 equal to v3's "
    "warmstart.json, or its dense probe reward on 64 probe prompts x 4 samples within 0.05 of v3's 0.398); v3's "
    "disjoint row sets (probe rows: task seed 2, test split; training rows: task seed 0, train split).",
    "a1": {
        "what": "32 probe prompts x 8 coupled samples per sampler (sparserl bias, 8 batches of 4 prompts, no "
        "gradients); every sequence scored densely; intervals: prompt-clustered bootstrap, 90%, 2000 draws",
        "prompts": 32,
        "samples": 8,
    },
    "a2": {
        "what": "K = 12 coupled batches of 4 prompts x 8 samples per sampler (sparserl bias --batches 12); the LoRA "
        "gradient at the first mini-batch (pi_theta = pi_old) of each estimator: naive, sparse-rl (the config's "
        "own corrections), seq-is (sequence-level IS, the reference), smd (Shadow Mask Distillation); split-half "
        "unbiased norms (U-statistics over distinct batches) and 90% intervals from 2000 batch-bootstrap draws",
        "batches": 12,
        "extended_batches": 24,
        "samplers": "dense, up to 4 real samplers (R1-eligible first, then those closest to eligibility by the "
        "reward ratio's lower bound) and both temperature controls",
        "estimators": ["naive", "sparse-rl", "seq-is", "smd"],
    },
    "R1": {
        "rule": "eligible if the reward ratio's lower bound >= 0.5 and >= 50% of groups non-degenerate; eviction "
        "samplers also need a retained saving >= 30% (mean held against the dense engine's own allocation). The "
        "paper's 35% saving is reported, not gated.",
        "reward_ratio_low_min": 0.5,
        "nondegenerate_min": 0.5,
        "saving_min": 0.30,
    },
    "R2": {
        "rule": "per sampler and estimator X against naive: 'corrections matter' if Gamma's lower bound >= 0.10 "
        "and (c_X - c_naive)'s lower bound > 0; 'inert' if Gamma's upper bound < 0.05; otherwise 'inconclusive'. "
        "If an interval is wider than +-0.05 at K = 12, extend once to K = 24 (the top 2 samplers only).",
        "gamma_matter_low": 0.10,
        "gamma_inert_high": 0.05,
        "extend_if_half_width_above": 0.05,
    },
    "R3": {
        "rule": "the temperature-1.3 control must come out 'corrections matter' (estimator sparse-rl). If it does "
        "not, the instrument or the correction code is wrong: fix it and conclude nothing.",
        "sampler": "temp1.3",
    },
    "R4": {
        "rule": "train (stage B) only if an eligible real sampler has (c_SRL / c_naive - 1)'s lower bound >= 0.25, "
        "or its TIS truncation share >= 10% with the veto catching at least half of those sequences; else "
        "stage B' at the temperature level with the largest gap (c_SRL - c_naive)",
        "relative_cosine_gain_min": 0.25,
        "truncation_share_min": 0.10,
        "veto_catch_min": 0.5,
    },
    "R5": {
        "rule": "dense, naive and Sparse-RL at the gated sampler (B': the temperature control); seeds 0-3; 28 "
        "rollouts x 4 prompts x 8 samples, 4 optimizer steps each (112 steps); learning rate by v3's pilot rule; "
        "held out on 128 prompts x 4, dense and sparse inference. Primary: Sparse-RL minus naive, held-out dense "
        "accuracy, paired one-sided t (df 3, alpha 0.05). Secondary (Holm): gain(SRL) - 0.75 x gain(dense) > 0; "
        "SRL minus dense under sparse inference. 'No difference' only through a paired TOST at +-0.05. Report "
        "whether the gap lies in the first-order prediction's interval.",
        "seeds": [0, 1, 2, 3],
        "rollouts": 28,
        "alpha": 0.05,
        "tost_margin": 0.05,
        "heldout": {"prompts": 128, "samples": 4},
    },
    "R6": {
        "rule": "Spearman rho between the sequence-touched share and (1 - c_naive) across the A2 samplers; "
        "supported if rho >= 0.83 (one-sided 5% at n = 6)",
        "rho_min": 0.83,
    },
    "validity": {
        "rule": "an outcome claim needs: R3 passed; dense gains >= +0.08 (paired); each eviction arm's reward over "
        "rollouts 1-10 >= 0.5x dense's; the sampler's mismatch over the last 10 rollouts (rollout_corr/k3_kl, "
        "touched share) >= 0.5x its A1 value, else report that the mechanism switched off during training. A "
        "block_topk stage B tests the correction mechanism only, not KV savings.",
        "dense_gain_min": 0.08,
        "early_reward_ratio_min": 0.5,
        "mismatch_kept_min": 0.5,
    },
}

GOALS = {
    "the temperature-1.3 control comes out 'corrections matter' (R3)": "corrections matter",
    "every rule R1-R6 judged and recorded": "all judged",
    "sparserl bias on the default config at K = 4, one thread (minutes)": 15.0,
    "warm start reproduced (sha256 equal, or probe reward within 0.05 of 0.398)": 0.05,
}


def r1_eligible(row: dict, evicting: bool) -> dict:
    """R1 on one A1 sampler's report (sparserl bias's `rollout` block): each clause and the verdict."""
    r = RULES["R1"]
    ratio_low = row["reward_ratio"]["low"]
    clauses = {
        "reward_ratio_low": ratio_low is not None and ratio_low >= r["reward_ratio_low_min"],
        "nondegenerate": row["nondegenerate_groups"]["value"] >= r["nondegenerate_min"],
    }
    if evicting:
        saving = row.get("kv_saving_mean_held", {}).get("value")
        clauses["saving"] = saving is not None and saving >= r["saving_min"]
    return {"clauses": clauses, "eligible": all(clauses.values())}


def a1_row(name: str, report: dict) -> dict:
    """What R1 and the A2 choice read from one A1 report, and R1's verdict."""
    r = report["rollout"]
    return {"reward_ratio": r["reward_ratio"], "nondegenerate_groups": r["nondegenerate_groups"],
            "kv_saving_mean_held": r["kv_saving_mean_held"], "touched_share": r.get("config/touched_share"),
            **r1_eligible(r, name in EVICTING)}  # fmt: skip


def a2_samplers(rows: dict[str, dict], real_max: int = 4) -> list[str]:
    """Stage A2's samplers: dense, up to `real_max` real samplers (R1-eligible first, then those closest to
    eligibility by the reward ratio's lower bound; ties by name), and both temperature controls."""
    real = [k for k in rows if k != "dense" and k not in CONTROLS]
    ranked = sorted(
        real, key=lambda k: (not rows[k]["eligible"], -(rows[k]["reward_ratio"]["low"] or 0.0), k)
    )
    return ["dense", *ranked[:real_max], *CONTROLS]


def r2_extend(report: dict) -> bool:
    """R2's extension trigger: some interval of Gamma or c_X - c_naive is wider than +-0.05."""
    limit = RULES["R2"]["extend_if_half_width_above"]
    for g in report.get("estimators", {}).values():
        for stat in ("gamma", "cosine_gain"):
            v = g.get(stat)
            if v and v["low"] is not None and (v["high"] - v["low"]) / 2 > limit:
                return True
    return False


def judge(a1: dict[str, dict], a2: dict[str, dict], default_bias_minutes: float | None, r3_round2: str | None = None
          ) -> dict:  # fmt: skip
    """R1-R4 and R6 from the stage reports ({sampler: sparserl bias report}); a rule whose inputs are missing is
    'not run' with the reason. R5 and the validity gate read the training stage, judged by its own report.
    `r3_round2`: the control's verdict on its fresh batches (study_v4_instrument.py round2), which replaces the
    first round's once it exists."""
    from scipy.stats import spearmanr

    out: dict = {}
    rows = {k: a1_row(k, r) for k, r in a1.items() if r.get("complete")}
    out["R1"] = {"status": "judged", "rows": rows} if len(rows) == len(SAMPLERS) else {
        "status": "not run", "reason": f"stage A1 has {len(rows)} of {len(SAMPLERS)} samplers"}  # fmt: skip
    verdicts = {k: {e: g["verdict"] for e, g in r.get("estimators", {}).items() if "verdict" in g}
                for k, r in a2.items() if r.get("complete")}  # fmt: skip
    out["R2"] = {"status": "judged" if verdicts else "not run", "verdicts": verdicts}
    control = r3_round2 or verdicts.get(RULES["R3"]["sampler"], {}).get("config")
    out["R3"] = {"status": "judged" if control else "not run", "verdict": control, "round": 2 if r3_round2 else 1,
                 "passed": control == "corrections matter" if control else None}  # fmt: skip
    gated = []
    for k, r in a2.items():
        if k == "dense" or k in CONTROLS or not rows.get(k, {}).get("eligible") or not r.get("estimators"):
            continue
        gain = r["estimators"]["config"]["relative_cosine_gain"]["low"]
        ro, r4 = r["rollout"], RULES["R4"]
        truncation = (ro["config/tis_truncation_share"]["value"] or 0) >= r4["truncation_share_min"] and (
            ro["config/veto_catch_of_truncated"]["value"] or 0) >= r4["veto_catch_min"]  # fmt: skip
        if (gain is not None and gain >= r4["relative_cosine_gain_min"]) or truncation:
            gated.append(k)
    out["R4"] = {"status": "judged" if verdicts else "not run", "gated_samplers": gated,
                 "stage": ("B" if gated else "B'") if verdicts else None}  # fmt: skip
    pairs = [
        (r["rollout"]["config/touched_share"]["value"], 1 - r["estimators"]["naive"]["cosine"]["value"])
        for r in a2.values()
        if r.get("estimators") and r["estimators"]["naive"]["cosine"]["value"] is not None
    ]
    rho = (
        float(spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic) if len(pairs) >= 3 else None
    )
    out["R6"] = {"status": "judged" if rho is not None else "not run", "rho": rho, "n": len(pairs),
                 "supported": rho >= RULES["R6"]["rho_min"] if rho is not None else None}  # fmt: skip
    out["R5"] = {"status": "not run", "reason": "training (stage B / B') has not run yet"}
    out["bias_default_minutes"] = default_bias_minutes
    return out
