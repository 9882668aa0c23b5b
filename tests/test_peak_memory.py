"""Peak memory of a run: reported in summary.json, no packed weight copy held through scoring and the update,
and freed activations returned to the system (glibc)."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
from test_trainer import make_trainer, tiny_cfg

from sparserl.engine import weights as packing
from sparserl.models import return_freed_memory
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
    assert packing._PACKED.get(lm) is not None  # kept for the rollout at the same version
    trainer.rollout(1)
    assert packing._PACKED.get(lm) is None
    trainer.close()


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt"
)
def test_return_freed_memory_sets_the_threshold() -> None:
    assert return_freed_memory()
