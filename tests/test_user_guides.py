"""docs/from_trl.md and docs/from_verl.md are scripts/user_guides.py's output, so they cannot drift from the config,
docs/metrics.md or the script's tables; every TRL loss, correction and sampling field has a row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import user_guides as ug  # noqa: E402
from guide_rows import LOSS, SAMPLING, eq, no  # noqa: E402

from sparserl.config import ConfigError  # noqa: E402


@pytest.fixture(scope="module")
def built() -> list[ug.Guide]:
    return ug.guides()


def test_the_committed_guides_are_the_scripts_output(built: list[ug.Guide]) -> None:
    assert [g.path.name for g in built] == ["from_trl.md", "from_verl.md"]
    for guide in built:
        assert guide.path.read_text() == ug.render(guide), (
            f"regenerate: python scripts/user_guides.py ({guide.path.name})"
        )


def test_every_trl_loss_correction_and_sampling_field_has_an_equivalent_or_a_reason() -> None:
    assert ug.unmapped(ug.TRL_FIELDS) == []
    bare = [
        ("loss_type=new", ug.Row(LOSS)),
        ("top_a", no(SAMPLING, "no top-a cut")),
        ("beta", eq(LOSS, "algo.kl_coef")),
    ]
    assert ug.unmapped(bare) == ["loss_type=new"]  # the count can fail
    goals = json.loads((ROOT / "docs" / "results" / "ecosystem.json").read_text())["goals"]
    assert goals[ug.GOAL]["value"] == 0 and goals[ug.GOAL]["met"] is True


def test_a_row_naming_a_key_or_value_the_config_does_not_have_is_refused() -> None:
    keys = ug.config_keys()
    with pytest.raises(SystemExit, match="not config keys"):
        ug.check_row("x", eq(LOSS, "algo.no_such_key"), keys)
    with pytest.raises(ConfigError):
        ug.check_row("x", eq(LOSS, "algo.policy_loss=no_such_loss"), keys)
    ug.check_row("x", eq(LOSS, "algo.loss_token_norm=<max_new_tokens>"), keys)  # a placeholder: the key alone
    with pytest.raises(SystemExit, match="not documented"):
        ug.check_metrics([("kl", "actor/no_such_metric", "")], "`actor/kl_ref`")
