"""Behaviour kept across refactors: short tiny-model runs give the metrics and final weights pinned in
tests/fixtures/behaviour_kept.json, which was written by the code before the seams redesign
(`python tests/test_behaviour_kept.py --write`, run with that code first on the import path). The distill arm was
re-pinned by DistillSparse v2, whose objective changed on purpose, and again when block-sparse groups came to
hold their prompt's whole pages once (for the reuse experiment: its peak KV bytes 0.55x, the same samples, the
update's metrics moved by float rounding, at most 2.3e-5 absolute, on a perplexity near 40). The three evicting arms
(default, cap_partial, epochs_kl_lora) were re-pinned when evicting groups came to hold their cut prompt once (for
the reuse experiment, engine/evicting_prefix.py): the same samples, peak KV bytes 0.74x, under the 1 MiB cap more
rows resident (rollout/occupancy), the update's metrics moved by float rounding (at most 1.9e-4 absolute, on a
largest importance ratio near 7.4 and a perplexity near 531). The first-run fixes added rollout/peak_dense_kv_bytes,
kv/naive_kv_bytes and rollout/entropy_estimate and made kv/dense_kv_bytes (and kv/saved_fraction with it) the
dense engine's own allocation; only those keys were re-pinned. The mismatch metrics of verl and NeMo-RL and the IS
ratio's spread before and after the corrections (rollout_corr/pearson_corr, token_mult_prob_error, gen_kl_error,
policy_kl_error, js_divergence_error, xi_std, weight_std, weight_min) were added by pinning only those keys, and
so was rollout/fork_prefills (requests naming a fork state admitted without it; none of these arms forks).

Bit-identical on the machine the fixture was written on (its `machine`: the vector unit torch dispatches to, the
CPU's feature flags, the torch and transformers versions); elsewhere the float sums may round differently (the same
AVX512 capability gave actor/grad_norm 26.56385 against a pinned 26.56383 on another machine or library build), so
there the metrics are compared to a relative 1e-4 (measured on a second AVX512 machine with the code the fixture
was written by: at most 4.1e-5, actor/pg_loss near 0.09) and the weight digest is skipped. A fixture without
`machine` is always compared so. The sequence-level chi-square exponentiates a sequence's summed log-ratio, so a
rounding difference d in that sum moves it by about 2d(1 + chi2): it is compared to a relative 5e-4 (an AMD EPYC
AVX512 machine gave 1.5e-4 on the distill arm's 1.48, every other metric within 8.4e-5).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_distill import distill_cfg  # noqa: E402
from tests.test_trainer import ParityTask, rows, tiny_cfg  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour_kept.json"
ARMS = {
    "default": (tiny_cfg, ["trainer.steps=3", "trainer.eval_prompts=2"]),
    "cap_partial": (
        tiny_cfg,
        [
            "trainer.steps=3",
            "rollout.partial.enable=true",
            "rollout.partial.max_staleness=3",
            "rollout.kv_memory_cap=1MiB",
        ],
    ),
    "epochs_kl_lora": (
        tiny_cfg,
        ["trainer.steps=2", "model.lora=true", "optim.ppo_epochs=2", "algo.kl_coef=0.05", "algo.preset=tis"],
    ),
    "distill": (distill_cfg, ["trainer.steps=2"]),
}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def machine() -> dict[str, str]:
    """What bit-identical float results depend on here, as far as a test can see it."""
    import transformers

    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags_sha256": hashlib.sha256(" ".join(sorted(flags.split()[2:])).encode()).hexdigest(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


EXPONENTIATED = {"rollout_corr/chi2_seq"}  # relative 5e-4 off the fixture's machine (docstring)


def _is_timing(key: str) -> bool:
    return key == "time" or key.startswith("time/") or key.endswith("_s") or "per_s" in key


def run_arm(tmp_path: Path, arm: str) -> dict:
    """Train one arm; its metrics (timings aside) and the digest of its final weights (and adapter)."""
    from sparserl.trainer import Trainer

    make_cfg, extra = ARMS[arm]
    trainer = Trainer(make_cfg(tmp_path, *extra, name=arm), task=ParityTask(), eval_task=ParityTask())
    try:
        trainer.train()
        weights = dict(trainer.policy.weights())
        if trainer.cfg.distill.enable:
            adapter = trainer.policy.adapter_weights(trainer.policy.distill_adapter)
            weights.update({f"distill/{k}": v for k, v in adapter.items()})
    finally:
        trainer.close()
    metrics = [{k: v for k, v in r.items() if not _is_timing(k)} for r in rows(tmp_path / arm)]
    return {"metrics": metrics, "weights_sha256": _digest(weights)}


@pytest.mark.parametrize("arm", list(ARMS))
def test_runs_match_the_fixture(tmp_path: Path, arm: str) -> None:
    pinned = json.loads(FIXTURE.read_text())
    want, got = pinned["arms"][arm], run_arm(tmp_path, arm)
    same_cpu = pinned.get("machine") == machine()
    assert len(got["metrics"]) == len(want["metrics"])
    for a, b in zip(got["metrics"], want["metrics"], strict=True):
        assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
        for k in a:
            if same_cpu or not isinstance(a[k], float):
                assert a[k] == b[k], (a["step"], k, a[k], b[k])
            else:
                rel = 5e-4 if k in EXPONENTIATED else 1e-4
                assert math.isclose(a[k], b[k], rel_tol=rel, abs_tol=1e-6), (a["step"], k, a[k], b[k])
    if same_cpu:
        assert got["weights_sha256"] == want["weights_sha256"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import tempfile

    torch.set_num_threads(1)
    out = {"machine": machine(), "arms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARMS:
            out["arms"][name] = run_arm(Path(tmp), name)
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(out, indent=1) + "\n")
