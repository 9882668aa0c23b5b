"""Users' own reward functions (TRL style): loading by spec, keyword arguments, weights with the built-in
reward, and the same fault isolation as the built-in rewards."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest

from sparserl.errors import UserError
from sparserl.tasks import BUILTIN_REWARD, TaskConfig, make_task, with_reward_fns
from sparserl.tasks.reward_fns import RewardFnTask
from sparserl.tasks.reward_loading import load_reward_function

ROWS = [
    {"question": "What is 2 + 7?", "answer": "9", "level": 1},
    {"question": "What is 3 + 3?", "answer": "6", "level": 2, "hint": "double"},
]
REWARDS_PY = '''
import json
import pathlib

CALLS = pathlib.Path(__file__).with_suffix(".calls.jsonl")  # it runs in a worker process: calls go to a file

def exact(completions, answer, trainer_state, log_metric, log_extra, **kwargs):
    """TRL style: the completions and the row's fields, one list each."""
    with CALLS.open("a") as f:
        f.write(json.dumps(dict(kwargs, completions=completions, answer=answer, step=trainer_state.global_step)) + "\\n")
    return [1.0 if f"\\\\boxed{{{a}}}" in c else 0.0 for c, a in zip(completions, answer, strict=True)]

def short(completions, **kwargs):
    return [1.0 if len(c) < 20 else 0.0 for c in completions]

NOT_A_FUNCTION = 3
'''


def write_data(tmp_path: Path) -> Path:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A module `my_rewards` importable by name (a fresh one per test)."""
    name = f"my_rewards_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    return module


def test_module_function_gets_trl_keyword_arguments(tmp_path: Path, user_module: Any) -> None:
    cfg = TaskConfig(name=str(write_data(tmp_path)), reward=[f"{user_module.__name__}:exact"])
    task = make_task(cfg)
    assert isinstance(task, RewardFnTask) and len(task) == 2 and task[1].answer == "6"
    completions = ["so \\boxed{9}", "so \\boxed{5}", "so \\boxed{6}"]
    examples = [task[0], task[0], task[1]]
    assert task.score_batch(completions, examples) == [1.0, 0.0, 1.0]
    (call,) = [json.loads(line) for line in user_module.CALLS.read_text().splitlines()]
    assert call["completions"] == completions
    assert call["answer"] == ["9", "9", "6"] and call["level"] == [1, 1, 2]
    assert call["hint"] == [None, None, "double"]  # a field some rows lack
    assert call["question"] == ["What is 2 + 7?", "What is 2 + 7?", "What is 3 + 3?"]
    assert call["prompts"] == [ex.messages for ex in examples]
    assert call["step"] == 0 and "completion_ids" not in call  # no trainer: no tokens, no update done
    assert task.score("\\boxed{9}", task[0]) == 1.0  # one completion is a batch of one
    assert (task.stats.calls, task.stats.errors, task.stats.timeouts) == (4, 0, 0)


def test_relative_file_spec_and_weights_with_the_builtin_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "rw").mkdir()
    (tmp_path / "rw" / "extra.py").write_text(REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    cfg = TaskConfig(
        name=str(write_data(tmp_path)),
        reward=[BUILTIN_REWARD, "rw/extra.py:short"],
        reward_weights=[1.0, 0.5],
    )
    task = make_task(cfg)
    long_right = "After some thought: \\boxed{9}"
    scores = task.score_batch(
        ["\\boxed{9}", long_right, "\\boxed{8}", "no idea at all, sorry"], [task[0]] * 4
    )
    assert scores == [1.5, 1.0, 0.5, 0.0]


def test_python_callable_on_a_generated_task() -> None:
    seen: dict[str, list] = {}

    def reward(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
        seen.update(kwargs, answer=answer)
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    base = make_task(TaskConfig())
    task = with_reward_fns(base, reward)
    assert task.stats is base.stats  # one set of reward/errors, reward/timeouts counters
    ex = task[0]
    assert task.score_batch([ex.answer, "x"], [ex, ex]) == [1.0, 0.0]
    assert seen["answer"] == [ex.answer] * 2 and seen["expression"] == [ex.meta["expression"]] * 2


def make_faulty(reward: Any, timeout: float = 5.0) -> RewardFnTask:
    return with_reward_fns(make_task(TaskConfig()), reward, timeout=timeout)


def test_a_raise_scores_zero_only_for_the_completions_it_fails_on() -> None:
    def picky(completions: list[str], **kwargs: Any) -> list[float]:
        if any("boom" in c for c in completions):
            raise RuntimeError("cannot score boom")
        return [1.0] * len(completions)

    task = make_faulty(picky)
    ex = task[0]
    assert task.score_batch(["a", "boom", "c"], [ex] * 3) == [1.0, 0.0, 1.0]
    assert (task.stats.calls, task.stats.errors, task.stats.timeouts) == (3, 1, 0)
    assert "picky" in task.stats.last_error and "cannot score boom" in task.stats.last_error


def test_a_hang_times_out_and_training_goes_on() -> None:
    def hangs(completions: list[str], **kwargs: Any) -> list[float]:
        time.sleep(30)
        return [1.0] * len(completions)

    task = make_faulty(hangs, timeout=0.3)
    start = time.monotonic()
    assert task.score_batch(["a", "b"], [task[0]] * 2) == [0.0, 0.0]
    assert time.monotonic() - start < 3.0
    assert (task.stats.calls, task.stats.errors, task.stats.timeouts) == (2, 0, 2)


@pytest.mark.parametrize(
    ("returned", "scores", "errors"),
    [
        ([1.0], [0.0, 0.0], 2),  # wrong count
        ([float("nan"), 0.5], [0.0, 0.5], 1),
        ([math.inf, 0.5], [0.0, 0.5], 1),
        (["high", 0.5], [0.0, 0.5], 1),
        (0.5, [0.0, 0.0], 2),  # not a list
        ([None, 0.5], [0.0, 0.5], 0),  # None: the function does not apply (TRL), not an error
    ],
)
def test_bad_return_values_score_zero_and_are_counted(
    returned: Any, scores: list[float], errors: int
) -> None:
    task = make_faulty(lambda completions, **kwargs: returned)
    assert task.score_batch(["a", "b"], [task[0]] * 2) == scores
    assert (task.stats.errors, task.stats.timeouts) == (errors, 0)


# ---------------------------------------------------------------------------------------------- bad specs


def test_bad_specs_are_one_clear_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "needs_dep.py").write_text("import not_installed_dependency_xyz\n")
    (tmp_path / "funcs.py").write_text(REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    cases = {
        "no_such_module_xyz:f": r"cannot import module 'no_such_module_xyz': ModuleNotFoundError",
        "needs_dep:f": r"cannot import module 'needs_dep'.*not_installed_dependency_xyz",
        "funcs.py:missing": r"funcs\.py has no function 'missing' \(it defines: exact, short\)",
        "funcs:NOT_A_FUNCTION": r"NOT_A_FUNCTION is a int, not a function",
        "gone/rewards.py:f": r"no such file gone/rewards\.py",
    }
    for spec, message in cases.items():
        with pytest.raises(UserError, match=re.escape(f"task.reward={spec!r}") + ".*" + message):
            load_reward_function(spec)
    with pytest.raises(UserError, match=r"task\.reward=.*funcs\.py:missing"):
        make_task(TaskConfig(reward=["funcs.py:missing"]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"reward": ["no_colon"]}, r"task\.reward entry 'no_colon' must be 'module:function'"),
        ({"reward": ["mod:"]}, r"task\.reward entry 'mod:'"),
        ({"reward": ["a:f", "b:g"], "reward_weights": [1.0]}, r"task\.reward_weights has 1 weights for 2"),
        ({"reward": ["a:f"], "reward_weights": [math.nan]}, r"task\.reward_weights.*finite"),
    ],
)
def test_bad_reward_settings_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        TaskConfig(**overrides)


def test_trainer_takes_a_python_reward_function(tmp_path: Path) -> None:
    """`Trainer(cfg, reward_fn=fn)` scores the rollouts with fn (batch call, TRL convention) in place of the
    task's own reward; the held-out evaluation uses it too."""
    from test_trainer import ParityTask, rows, tiny_cfg

    from sparserl.trainer import Trainer

    seen: list[int] = []

    def always_one(completions, prompts, **kwargs):
        seen.append(len(completions))
        return [1.0] * len(completions)

    cfg = tiny_cfg(tmp_path, "trainer.steps=1", "trainer.eval_prompts=2", "rollout.async_rewards=false")
    Trainer(cfg, task=ParityTask(), eval_task=ParityTask(), reward_fn=always_one).train()
    step = [r for r in rows(tmp_path / "run") if "reward/mean" in r][0]
    assert step["reward/mean"] == 1.0
    assert 8 in seen  # synchronous: one call for the whole rollout batch (2 prompts x 4)
    seen.clear()
    cfg = tiny_cfg(tmp_path, "trainer.steps=1", name="async")
    Trainer(cfg, task=ParityTask(), reward_fn=always_one).train()
    assert seen == [4, 4]  # asynchronous (the default): one call per group, as each group finishes
    evals = [r["eval/dense/reward"] for r in rows(tmp_path / "run") if "eval/dense/reward" in r]
    assert evals == [1.0, 1.0]
