"""Peak memory of a run: reported in summary.json, no packed weight copy held through scoring and the update,
and freed activations returned to the system (glibc)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer import make_trainer, tiny_cfg

from sparserl.config import ConfigError
from sparserl.engine import weights as packing
from sparserl.trainer.logging import memory_text


def test_summary_reports_the_peak_rss(tmp_path: Path) -> None:
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.steps=1"))
    summary = trainer.train()
    trainer.close()
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["peak_rss_bytes"] == summary["peak_rss_bytes"] > 50 * 2**20
    assert saved["peak_rss_bytes_by_process"] == {"trainer": saved["peak_rss_bytes_all_processes"]}
    assert memory_text(saved).endswith("GiB (this process)")


def test_the_packed_copy_is_dropped_after_the_rollout(tmp_path: Path) -> None:
    """Scoring and the update never read the packed copy, and the update makes it stale: holding it through
    them only raised the run's peak."""
    trainer = make_trainer(tiny_cfg(tmp_path, "trainer.eval_prompts=2", "trainer.steps=1"))
    lm = trainer.policy.module
    trainer.evaluate(0)
    assert packing.holds_packed(lm)  # kept for the rollout at the same version
    trainer.rollout(1)
    assert not packing.holds_packed(lm)
    trainer.close()


GLIBC = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)
# In a fresh process: the threshold set (or not), then 40 tensors of 512 KiB made, written and freed one after
# another; prints the minor page faults they took.
FAULTS = """
import resource, sys, torch
from sparserl.models import return_freed_memory
print(return_freed_memory(int(sys.argv[1])))
torch.empty(2**17).fill_(1.0)  # glibc's own threshold rises past a block freed once
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(40):
    torch.empty(2**17).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(threshold: int) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, str(threshold)], capture_output=True, text=True, check=True
    )
    was_set, faults = out.stdout.split()
    return was_set, int(faults)


@GLIBC
def test_the_mmap_threshold_returns_freed_blocks_and_0_leaves_glibcs_own() -> None:
    """128 KiB: every 512 KiB block is a mapping of its own, unmapped when freed, so each new one faults its 128
    pages afresh; 0 (nothing set): glibc keeps the freed block in its heap and the next one reuses it."""
    assert _faults(131072) == ("True", pytest.approx(40 * 128, rel=0.1))
    was_set, faults = _faults(0)
    assert was_set == "False" and faults < 40 * 128 // 4  # the first blocks grow the heap (384 here)


@GLIBC
def test_the_run_sets_the_configured_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sparserl.models

    seen = []
    monkeypatch.setattr(sparserl.models, "return_freed_memory", seen.append)
    make_trainer(tiny_cfg(tmp_path, "trainer.malloc_mmap_threshold=262144")).close()
    assert seen == [262144]


def test_a_threshold_above_glibcs_largest_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.malloc_mmap_threshold=67108864 .* 32 MiB"):
        tiny_cfg(tmp_path, "trainer.malloc_mmap_threshold=67108864")
