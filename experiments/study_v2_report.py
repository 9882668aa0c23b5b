"""Study v2's report: per-arm curves and held-out accuracies as mean +- standard deviation over the
seeds done, the study's four goals, docs/results/study_v2/study_v2.json and study_v2.png. Reads only finished
parts (docs/results/study_v2/parts/; a run's curves are copied there from runs/study_v2/<arm>-seed<s>/metrics.jsonl
once it is done), so it can run at any time.

Standard errors of an arm's held-out accuracy: over seeds (sd / sqrt(seeds)) once an arm has two or more, else
over the held-out prompts of its one seed (noted in the goal as "stderr_over"). A collapse, fixed before any run:
the mean reward of the last 5 steps below half the arm's best 5-step mean, or the mean length of the last 5
steps below half that of the first 5.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from sparse_parts import cached, positions_read, read_part, read_part_if_done
from study import read_metrics, write_atomic
from study_v2_setup import (
    ARMS,
    COMMAND,
    GOAL_TARGETS,
    PARTS,
    RESULTS,
    RUNS,
    SAVED_MIN,
    TAU,
    unmeasured,
    write_result,
)

CURVES = {  # per-step series: name -> metrics.jsonl key (docs/metrics.md)
    "reward": "reward/mean",
    "length": "length/mean",
    "rejection_rate": "rejection_rate",
    "mismatch_kl": "rollout_corr/kl",
    "mismatch_k3_kl": "rollout_corr/k3_kl",
    "token_keep_fraction": "rollout_corr/token_keep_fraction",
    "kv_saved_fraction": "kv/saved_fraction",
    "time_rollout": "time/rollout",
    "time_score": "time/score",
    "time_update": "time/train",
    "time_step_cpu": "time/step_cpu",
}
MODES = ("dense", "rkv", "block_topk_tau086")
WINDOW = 5  # steps averaged at the start and end of a curve


def curves(run: Path) -> dict[str, list]:
    """The per-step series of one run, plus the alpha tail (P5 of exact alpha per bin) when logged."""
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    keys = dict(CURVES)
    keys.update(
        {
            k.replace("alpha/exact/p5/", "alpha_p5_"): k
            for r in rows
            for k in r
            if k.startswith("alpha/exact/p5/")
        }
    )
    out = {"step": [r["step"] for r in rows]}
    out.update({name: [r.get(key) for r in rows] for name, key in sorted(keys.items())})
    return out


def run_curves(name: str) -> dict[str, list]:
    """A finished run's curves, kept as a part (parts/curves/<run>.json) the first time the report sees the run, so
    the report never needs the run directory again (run directories are not committed)."""

    def make() -> dict[str, list]:
        out = curves(RUNS / name)
        if not out["step"]:
            raise SystemExit(f"{RUNS / name}/metrics.jsonl: missing or empty, and no curves part for {name}")
        return out

    return {k: v for k, v in cached(PARTS / "curves" / f"{name}.json", make).items() if isinstance(v, list)}


def mean_sd(values: list[float]) -> dict[str, float | int]:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}  # fmt: skip


def across_seeds(series: list[list[float | None]]) -> dict[str, list]:
    """Mean and sd per step over the seeds' series (steps a seed has not reached, or None, left out)."""
    out: dict[str, list] = {"mean": [], "sd": []}
    for i in range(max(map(len, series), default=0)):
        vals = [s[i] for s in series if i < len(s) and s[i] is not None]
        stats = mean_sd(vals) if vals else {"mean": None, "sd": None}
        out["mean"].append(stats["mean"])
        out["sd"].append(stats["sd"])
    return out


def collapsed(c: dict[str, list]) -> bool:
    """The study's collapse rule (module docstring) on one run's curves."""
    reward, length = c["reward"], c["length"]
    if len(reward) < 2 * WINDOW:
        return False
    windows = [statistics.fmean(reward[i : i + WINDOW]) for i in range(len(reward) - WINDOW + 1)]
    first_len, last_len = statistics.fmean(length[:WINDOW]), statistics.fmean(length[-WINDOW:])
    return windows[-1] < 0.5 * max(windows) or last_len < 0.5 * first_len


def arm_summary(parts: dict[int, dict], runs: dict[int, dict]) -> dict[str, Any]:
    """Held-out accuracy per mode over the seeds (mean, sd, standard error), KV saved, collapse per seed."""
    out: dict[str, Any] = {"seeds": sorted(parts)}
    for mode in sorted({m for p in parts.values() for m in p if isinstance(p[m], dict)}):
        accs = [p[mode]["accuracy"] for p in parts.values() if mode in p]
        stats = mean_sd(accs)
        if len(accs) > 1:
            stats["stderr"], stats["stderr_over"] = stats["sd"] / len(accs) ** 0.5, "seeds"
        else:
            stats["stderr"], stats["stderr_over"] = next(iter(parts.values()))[mode]["stderr"], "prompts"
        stats["mean_length"] = statistics.fmean(p[mode]["mean_length"] for p in parts.values() if mode in p)
        out[mode] = stats
    kv = [statistics.fmean(v for v in c["kv_saved_fraction"] if v is not None) for c in runs.values()
          if any(v is not None for v in c["kv_saved_fraction"])]  # fmt: skip
    out["train_kv_saved_fraction"] = statistics.fmean(kv) if kv else None
    out["collapsed"] = {seed: collapsed(c) for seed, c in runs.items()}
    steps = [c["time_step_cpu"] for c in runs.values()]
    out["time_per_step_s"] = {name: statistics.fmean(v for c in runs.values() for v in c[name] if v is not None)
                              for name in ("time_rollout", "time_score", "time_update") if any(c[name] for c in runs.values())}  # fmt: skip
    out["cpu_s_per_step"] = statistics.fmean(v for s in steps for v in s if v is not None) if steps else None
    return out


def gap(a: dict, b: dict, mode: str) -> tuple[float, float]:
    """a - b in held-out accuracy under `mode`, and the standard error of the difference."""
    return a[mode]["mean"] - b[mode]["mean"], (a[mode]["stderr"] ** 2 + b[mode]["stderr"] ** 2) ** 0.5


def goals(arms: dict[str, dict], base: dict | None, speed: dict) -> dict:
    """The issue's four goals from the arms done; a goal whose arms are missing stays not measured."""
    out = unmeasured("not measured yet: an arm it compares has not finished (see 'seeds_done')")

    def measured(name: str, value: float | None, met: bool, compared: tuple[str, ...], **extra: Any) -> None:
        out[name] = {
            "value": value,
            "target": GOAL_TARGETS[name],
            "met": bool(met),
            "command": COMMAND,
            "seeds": {arm: arms[arm]["seeds"] for arm in compared},  # provisional until every seed is done
            **extra,
        }

    dense, srl, naive = arms.get("dense"), arms.get("sparse-rl-rkv"), arms.get("naive-sparse-rkv")
    if srl and naive:
        g, se = gap(srl, naive, "dense")
        # "degrades relative to Sparse-RL": a naive collapse counts where Sparse-RL's run of that seed held
        alone = [s for s, fell in naive["collapsed"].items() if fell and srl["collapsed"].get(s) is False]
        measured("naive_sparse_degrades", g, g > 2 * se or bool(alone), ("sparse-rl-rkv", "naive-sparse-rkv"), stderr=se,
                 naive_collapsed=naive["collapsed"], sparse_rl_collapsed=srl["collapsed"],
                 met_by_any_naive_collapse=g > 2 * se or any(naive["collapsed"].values()),
                 note="Sparse-RL minus naive R-KV, held-out accuracy under dense inference")  # fmt: skip
    if srl and dense and base:
        b = base["dense"]["accuracy"]
        gains = srl["dense"]["mean"] - b, dense["dense"]["mean"] - b
        ratio = gains[0] / gains[1] if gains[1] > 0 else None
        saved = srl["train_kv_saved_fraction"] or 0.0
        measured("sparse_rl_keeps_dense_gain", ratio, ratio is not None and ratio >= 0.97 and saved >= SAVED_MIN,
                 ("sparse-rl-rkv", "dense"),
                 sparse_rl_gain=gains[0], dense_gain=gains[1], kv_saved_fraction=saved,
                 note="held-out gains over the starting model under dense inference" +
                 ("" if gains[1] > 0 else "; the dense arm gained nothing, so no ratio"))  # fmt: skip
    if srl and dense:
        g, se = gap(srl, dense, "rkv")
        measured("sparse_rl_model_under_sparse_inference", g, g >= 0, ("sparse-rl-rkv", "dense"), stderr=se,
                 note="Sparse-RL (R-KV) minus dense-trained, held-out accuracy under R-KV inference")  # fmt: skip
    s086, s075 = arms.get("sparrow-tau086"), arms.get("sparrow-tau075")
    if dense and s086 and s075 and speed:
        g, se = gap(s086, dense, "dense")
        g75, se75 = gap(s075, dense, "dense")
        faster = speed["schedule_tau086"]["tokens_per_cpu_s"] / speed["dense"]["tokens_per_cpu_s"]
        degrades = g75 < -2 * se75 or any(s075["collapsed"].values())
        measured("sparrow", g, abs(g) <= 2 * se and faster > 1 and degrades, ("sparrow-tau086", "sparrow-tau075", "dense"),
                 stderr=se,
                 tokens_per_cpu_s_ratio_tau086_to_dense=faster, tau075_minus_dense=g75, tau075_stderr=se75,
                 tau075_collapsed=s075["collapsed"], note="tau 0.86 minus dense, held-out accuracy under dense inference")  # fmt: skip
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "train reward"), ("length", "response length (tokens)"),
              ("rejection_rate", "rejection rate"), ("mismatch_kl", "sampler/dense KL (rollout_corr/kl)")]  # fmt: skip
    fig, grid = plt.subplots(2, 3, figsize=(18, 8))
    ax = grid.ravel()  # the curve panels, then the alpha tail, then the held-out bars
    for arm, c in result["curves"].items():
        for i, (name, title) in enumerate(panels):
            m, sd = c[name]["mean"], c[name]["sd"]
            xs = [x for x, v in zip(c["step"], m, strict=False) if v is not None]
            ys = [v for v in m if v is not None]
            ax[i].plot(xs, ys, label=arm)
            low = [v - s for v, s in zip(m, sd, strict=True) if v is not None]
            high = [v + s for v, s in zip(m, sd, strict=True) if v is not None]
            ax[i].fill_between(xs, low, high, alpha=0.2)
            ax[i].set(title=title, xlabel="step")
        for key in sorted(k for k in c if k.startswith("alpha_p5_")):
            ax[-2].plot(c["step"][: len(c[key]["mean"])], c[key]["mean"], label=f"{arm} {key[9:]}")
    ax[-2].axhline(TAU, color="grey", linestyle="--")
    ax[-2].set(title="P5 of exact alpha per bin (Sparrow arms)", xlabel="step")
    names = list(result["heldout"])
    for j, mode in enumerate(MODES):
        vals = [result["heldout"][n].get(mode, {}) for n in names]
        ax[-1].bar([i + 0.27 * j for i in range(len(names))], [v.get("mean", 0) for v in vals], 0.27,
                   yerr=[v.get("stderr", 0) for v in vals], label=mode)  # fmt: skip
    ax[-1].set(title="held-out accuracy (+- s.e.)", xticks=[i + 0.27 for i in range(len(names))])
    ax[-1].set_xticklabels(names, rotation=30, fontsize=7)
    for a in ax:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def last(c: dict, name: str, seeds: int) -> str:
    """The mean (+- sd, once there are several seeds) over seeds of a curve's last WINDOW steps, as text."""
    m, sd = c[name]["mean"][-WINDOW:], c[name]["sd"][-WINDOW:]
    pairs = [(a, b) for a, b in zip(m, sd, strict=True) if a is not None]
    if not pairs:
        return "-"
    spread = f" +- {statistics.fmean(b for _, b in pairs):.3f}" if seeds > 1 else ""
    return f"{statistics.fmean(a for a, _ in pairs):.3f}{spread}"


def heldout_cell(v: dict) -> str:
    """One held-out accuracy as text: the mean, +- sd once there are several seeds, and (standard error)."""
    return f"{v['mean']:.3f}" + (f" +- {v['sd']:.3f}" if v.get("n", 1) > 1 else "") + f" ({v['stderr']:.3f})"


def markdown(result: dict) -> str:
    """The report's tables (docs/results/study_v2/results.md)."""
    lines = ["# Study v2: results so far (generated by `python experiments/study_v2.py report`)", "",
             "Held-out accuracy (128 prompts x 4 samples): mean +- sd over seeds (standard error: over seeds, or over prompts "
             "while one seed is done).", "",
             "| model | seeds | dense inference | R-KV inference | block_topk tau 0.86 inference |", "|---|---|---|---|---|"]  # fmt: skip
    for name, modes in result["heldout"].items():
        cells = [heldout_cell(v) if (v := modes.get(m)) else "-" for m in MODES]
        seeds = ",".join(map(str, result["seeds_done"].get(name, []))) or "-"
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " |")
    extra = [f"{arm} under {m} {heldout_cell(v)}" for arm, a in result["arms"].items()
             for m, v in a.items() if m.startswith("block_topk_") and m not in MODES]  # fmt: skip
    lines += ["", "Also held out: " + ", ".join(extra)] if extra else []
    lines += ["", f"Training, mean +- sd over seeds of the last {WINDOW} steps; seconds per step (rollout / scoring / "
              "update) and CPU seconds per step averaged over all steps.", "",
              "| arm | reward | length | rejection rate | sampler/dense KL | KV saved | s/step (rollout / score / update) | CPU s/step | collapsed |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, c in result["curves"].items():
        a = result["arms"][arm]
        split = " / ".join(f"{v:.0f}" for v in a["time_per_step_s"].values())
        cols = [
            last(c, name, len(a["seeds"]))
            for name in ("reward", "length", "rejection_rate", "mismatch_kl", "kv_saved_fraction")
        ]
        fell = [str(seed) for seed, yes in a["collapsed"].items() if yes]
        lines.append(f"| {arm} | " + " | ".join(cols) + f" | {split} | {a['cpu_s_per_step']:.0f} | "
                     + (f"seeds {', '.join(fell)}" if fell else "no") + " |")  # fmt: skip
    lines += ["", "Positions read per decode step (sparse layers): " +
              ", ".join(f"{k} {v:.0f}" for k, v in result["positions_read"].items()), "",
              "Rollout tokens per CPU second: " +
              (", ".join(f"{k} {v:.1f}" for k, v in result["throughput_tokens_per_cpu_s"].items()) or "not measured yet"), ""]  # fmt: skip
    if result.get("recall"):
        lines += [recall_line(result["recall"]), ""]
    lines += ["## Goals", ""] + [goal_line(k, g) for k, g in result["goals"].items()]
    return "\n".join(lines) + "\n"


def recall_line(recall: dict) -> str:
    """The recall check (study_v2_recall.py) in one sentence per sampler."""
    kv = recall["kv"]
    cells = []
    for mode in ("dense", kv["method"]):
        t = recall[mode]
        right, wrong = t["recalled"], t["misrecalled"]
        acc = ["n/a" if c["accuracy"] is None else f"{c['accuracy']:.3f}" for c in (right, wrong)]
        cells.append(f"{mode} accuracy {t['accuracy']:.3f}, values restated right {right['share']:.0%} "
                     f"(accuracy {acc[0]}), wrong {wrong['share']:.0%} (accuracy {acc[1]})")  # fmt: skip
    return (f"Recall check (the starting model, {recall['prompts']} prompts x {recall['samples']} samples, "
            f"{kv['method']} {kv['budget']}): " + "; ".join(cells))  # fmt: skip


def goal_line(name: str, goal: dict) -> str:
    """One goal in words: verdict, target, value, every measured number beside it, collapses and seeds."""
    head = f"- {'MET' if goal['met'] else 'NOT MET'} {name} ({goal['target']}): "
    if "reason" in goal:  # not measured: its arms have not finished
        return head + goal["reason"]
    value = "n/a" if goal["value"] is None else f"{goal['value']:+.3f}"
    numbers = [f"{k} {v:.3f}" for k, v in goal.items() if k != "value" and isinstance(v, float)]
    fell = [f"{k} seeds {', '.join(str(s) for s, yes in v.items() if yes) or 'none'}" for k, v in goal.items()
            if k.endswith("collapsed")]  # fmt: skip
    seeds = "; ".join(f"{arm} {','.join(map(str, s))}" for arm, s in goal["seeds"].items())
    return head + "; ".join([value, *numbers, *fell]) + f" (seeds: {seeds}). {goal['note']}"


def report() -> dict:
    """Rebuild the report from every finished part; returns it."""
    done: dict[str, dict[int, dict]] = {}
    for part in sorted((PARTS / "heldout").glob("*-seed*.json")):
        arm, seed = part.stem.rsplit("-seed", 1)
        done.setdefault(arm, {})[int(seed)] = read_part(part)
    runs = {arm: {s: run_curves(f"{arm}-seed{s}") for s in seeds} for arm, seeds in done.items()}
    base = read_part_if_done(PARTS / "heldout" / "base.json")
    speed = read_part_if_done(PARTS / "throughput.json", {})
    cal = read_part_if_done(PARTS / "calibration.json")
    arms = {arm: arm_summary(done[arm], runs[arm]) for arm in ARMS if arm in done}
    heldout = (
        {"starting model": {m: {"mean": base[m]["accuracy"], "stderr": base[m]["stderr"]} for m in MODES}}
        if base
        else {}
    )
    heldout.update({arm: {m: s[m] for m in MODES if m in s} for arm, s in arms.items()})
    result = {
        "experiment": "Study v2: dense vs naive and Sparse-RL eviction vs Sparrow block_topk, long-context recall",
        "command": COMMAND,
        "seeds_done": {arm: sorted(s) for arm, s in done.items()},
        "arms": arms,
        "heldout": heldout,
        "curves": {arm: {"step": max((c["step"] for c in runs[arm].values()), key=len),
                         **{k: across_seeds([c[k] for c in runs[arm].values()]) for k in next(iter(runs[arm].values())) if k != "step"}}
                   for arm in arms},  # fmt: skip
        "positions_read": {name: positions_read(cal[name], cal["table"]) for name in ("schedule_tau086", "schedule_tau075")} if cal else {},
        "throughput_tokens_per_cpu_s": {k: v["tokens_per_cpu_s"] for k, v in speed.items() if isinstance(v, dict)},
        "scoping": "docs/results/study_v2/scoping.json",
        **{k: read_part_if_done(PARTS / f"{k}.json") for k in ("recall", "step_prompts")},
    }  # fmt: skip
    scoping = read_part_if_done(RESULTS / "scoping.json", {})
    if scoping.get("chosen_budget"):  # an eviction cache holds at most budget + interval - 1 positions
        result["positions_read"]["eviction (at most)"] = (
            scoping["chosen_budget"] + scoping["setting"]["interval"] - 1
        )
        result["positions_read"]["dense (prompt + 128, at most)"] = (
            scoping["setting"]["prompt_tokens_mean"] + scoping["setting"]["max_new_tokens"]
        )
    result["goals"] = goals(arms, base, speed)
    write_result(result, RESULTS / "study_v2.json", result["goals"])
    # every other result file carries the goals on top too (kv.schedule files: the loader reads "schedule" alone)
    for part in [*PARTS.rglob("*.json"), *RESULTS.glob("*.json")]:
        if part.name != "study_v2.json":
            write_result(json.loads(part.read_text()), part, result["goals"])
    write_atomic(RESULTS / "results.md", markdown(result))
    if arms:
        plot(result, RESULTS / "study_v2.png")
    return result
