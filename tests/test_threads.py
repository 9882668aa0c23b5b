"""The thread settings reach torch: the `sparserl` command's OpenMP spin default (in the environment before torch
loads OpenMP; a user's own value wins) and `trainer.threads` (0 leaves torch's default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ENV_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
USER_ONLY = [{"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"KMP_BLOCKTIME": "7"}]

# One child process (torch loads once): registers a test-only subcommand that reports the environment it sees and
# runs it through cli.main once per case (the user's thread variables, config overrides); with overrides it also
# builds a tiny Trainer, which applies trainer.threads, and reports torch's thread count before and after.
PROBE = textwrap.dedent(
    """
    import json, os, sys
    assert "torch" not in sys.modules, "OpenMP reads its environment when torch loads: main() must run first"
    from sparserl import cli

    KEYS, results = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"), []

    @cli.command("probe-threads", "Test only: report the thread settings.", cli.arg("overrides", nargs="*"))
    def probe(args):
        out = {"env": {k: os.environ.get(k) for k in KEYS}}
        if args.overrides:
            import torch
            from sparserl.config import load_config
            from sparserl.trainer import Trainer

            out["default_threads"] = torch.get_num_threads()
            Trainer(load_config(None, args.overrides)).close()
            out["threads"] = torch.get_num_threads()
        results.append(out)
        return 0

    for user_env, overrides in json.loads(sys.argv[1]):
        for k in KEYS:
            os.environ.pop(k, None)
        os.environ.update(user_env)
        assert cli.main(["probe-threads", *overrides]) == 0
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What the child saw in each case: default env + threads 0, ACTIVE + threads 1, then `USER_ONLY`."""
    out_dir = tmp_path_factory.mktemp("runs")
    tiny = ["model.spec=tiny-llama", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8",
            "kv.budget=24", "kv.interval=4", "task.num_examples=4", "trainer.eval_prompts=0",
            "logging.progress=false", f"trainer.output_dir={out_dir}"]  # fmt: skip
    cases = [({}, [*tiny, "trainer.run_name=zero", "trainer.threads=0"]),
             ({"OMP_WAIT_POLICY": "ACTIVE"}, [*tiny, "trainer.run_name=one", "trainer.threads=1"]),
             *((user, []) for user in USER_ONLY)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in (*ENV_KEYS, "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_default_spins_briefly_and_threads_zero_keeps_torchs_default(seen: list[dict]) -> None:
    assert seen[0]["env"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000", "KMP_BLOCKTIME": "0"}
    assert seen[0]["threads"] == seen[0]["default_threads"]  # 0 leaves torch's default (all cores)


def test_user_wait_policy_wins_and_trainer_threads_is_applied(seen: list[dict]) -> None:
    # GOMP_SPINCOUNT would override the user's ACTIVE policy in libgomp, so the command sets nothing
    assert seen[1]["env"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None, "KMP_BLOCKTIME": None}
    assert seen[1]["threads"] == 1


@pytest.mark.parametrize("i", range(len(USER_ONLY)))
def test_user_spin_settings_win(seen: list[dict], i: int) -> None:
    assert seen[2 + i]["env"] == {k: USER_ONLY[i].get(k) for k in ENV_KEYS}
