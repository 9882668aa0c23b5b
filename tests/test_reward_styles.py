"""Reward functions as TRL and verl users write them: the shapes of TRL's GRPO documentation run unchanged
(token ids, conversational completions, None for 'does not apply', async def), a function gets only the
keywords it names, log_metric / log_extra come back from the worker, verl's compute_score is detected by its
signature, and an async function's failures are handled like a sync one's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sparserl.errors import UserError
from sparserl.tasks import TaskConfig, make_task, with_reward_fns
from sparserl.tasks.reward_fns import RewardFnTask

# The shapes of the reward functions in TRL's GRPO documentation ("Using a custom reward function"), written
# anew here; they run as a TRL user's file would, unchanged.
TRL_DOCS_PY = r'''
import asyncio
import re


def token_count(completions_ids, **kwargs):
    """Longer completions, counted in tokens, score more."""
    return [float(len(ids)) for ids in completions_ids]


def char_count(completions, **kwargs):
    """Longer completions, counted in characters, score more."""
    return [float(len(text)) for text in completions]


def think_answer_format(completions, **kwargs):
    """Conversational data: each completion is a list of messages, the first holding the text."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]


def boxed_matches(completions, ground_truth, **kwargs):
    """1 when the \boxed{} content equals the row's `ground_truth` column."""
    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    return [1.0 if m and m.group(1) == truth else 0.0 for m, truth in zip(found, ground_truth)]


def math_only(prompts, completions, task, **kwargs):
    """A multi-task dataset: None where the row is not a math problem."""
    return [(1.0 if "4" in c else -1.0) if t == "math" else None for c, t in zip(completions, task)]


def code_only(prompts, completions, task, **kwargs):
    return [(1.0 if "def " in c else -1.0) if t == "code" else None for c, t in zip(completions, task)]


async def non_empty(prompts, completions, **kwargs):
    """An async function, as one waiting on a remote service would be."""
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]
'''

OURS_PY = r'''
import asyncio
import time


def only_completions(completions):
    return [float(len(c)) for c in completions]


def ids_and_state(completion_ids, trainer_state):
    return [len(ids) + 10 * trainer_state.global_step + 1000 * trainer_state.max_steps for ids in completion_ids]


def logging_reward(completions, log_metric, log_extra, **kwargs):
    log_metric("mean_chars", sum(len(c) for c in completions) / len(completions))
    log_extra("chars", [len(c) for c in completions])
    log_extra("short", [1, 2, 3][: len(completions) - 1])  # one value short: dropped
    return [1.0] * len(completions)


def sync_raises(completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("cannot score boom")
    return [1.0] * len(completions)


async def async_raises(completions, **kwargs):
    await asyncio.sleep(0)
    if any("boom" in c for c in completions):
        raise ValueError("cannot score boom")
    return [1.0] * len(completions)


async def async_hangs(completions, **kwargs):
    await asyncio.sleep(30)
    return [1.0] * len(completions)


_EVENTS = {}


def _event(name):
    """An event of the running loop: functions awaited together share one loop, one after another do not."""
    return _EVENTS.setdefault((id(asyncio.get_running_loop()), name), asyncio.Event())


async def waits_for_second(completions, **kwargs):
    _event("first").set()
    await asyncio.wait_for(_event("second").wait(), 2)  # never set unless `waits_for_first` runs meanwhile
    return [1.0] * len(completions)


async def waits_for_first(completions, **kwargs):
    _event("second").set()
    await asyncio.wait_for(_event("first").wait(), 2)
    return [2.0] * len(completions)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: one completion at a time."""
    ok = ground_truth in solution_str and data_source == "openai/gsm8k" and extra_info["index"] >= 0
    return 1.0 if ok else 0.0


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    hit = ground_truth in solution_str
    return {"score": float(hit), "acc": hit, "pred": solution_str[-3:]}
'''


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "trl_docs.py").write_text(TRL_DOCS_PY)
    (tmp_path / "ours.py").write_text(OURS_PY)
    return tmp_path


def rewarded(data: Path, spec: str | list[str], **cfg: object) -> RewardFnTask:
    task = make_task(TaskConfig(name=str(data), reward=[spec] if isinstance(spec, str) else spec, **cfg))
    assert isinstance(task, RewardFnTask)
    return task


def standard_rows(tmp_path: Path) -> Path:
    return write_rows(
        tmp_path / "mixed.jsonl",
        [
            {"question": "Solve 2x + 3 = 7.", "ground_truth": "2", "task": "math"},
            {"question": "Write a function that adds two numbers.", "ground_truth": "-", "task": "code"},
        ],
    )


def test_trl_documentation_examples_run_unchanged(files: Path) -> None:
    data = standard_rows(files)
    docs = files / "trl_docs.py"
    task = rewarded(data, f"{docs}:token_count", answer_key="ground_truth")
    ex = [task[0], task[1]]
    assert task.score_logged(["a", "b"], ex, completion_ids=[[6303, 13], [304, 279, 12884, 13]])[0] == [
        2.0,
        4.0,
    ]
    assert rewarded(data, f"{docs}:char_count", answer_key="ground_truth").score_batch(
        [" blue.", " in the sky."], ex
    ) == [6.0, 12.0]
    boxed = rewarded(data, f"{docs}:boxed_matches", answer_key="ground_truth")
    assert boxed.score_batch(["so \\boxed{2}.", "so \\boxed{6}."], ex) == [1.0, 0.0]
    multi = rewarded(data, [f"{docs}:math_only", f"{docs}:code_only"], answer_key="ground_truth")
    assert multi.score_batch(["2 + 2 is 4", "def add(a, b): return a + b"], ex) == [1.0, 1.0]
    assert multi.score_batch(["five", "no code"], ex) == [-1.0, -1.0]  # None is 'does not apply', not 0
    asynchronous = rewarded(data, f"{docs}:non_empty", answer_key="ground_truth")
    assert asynchronous.score_batch(["text", ""], ex) == [1.0, 0.0]
    for t in (task, boxed, multi, asynchronous):
        assert t.stats.errors == t.stats.timeouts == 0, t.stats.last_error
        t.close()


def test_conversational_data_gets_message_completions(files: Path) -> None:
    """As TRL decides it: a prompt column of {role, content} messages makes completions message lists."""
    data = write_rows(
        files / "chat.jsonl",
        [{"prompt": [{"role": "user", "content": "What is (1 + 2) * 4?"}], "answer": "12"}],
    )
    task = rewarded(data, f"{files / 'trl_docs.py'}:think_answer_format")
    good = "<think>3 times 4 is 12.</think><answer>(1 + 2) * 4 = 12</answer>"
    assert task.score_batch([good, "It is 12."], [task[0]] * 2) == [1.0, 0.0]
    assert task.stats.errors == 0
    plain = rewarded(standard_rows(files), f"{files / 'trl_docs.py'}:think_answer_format")
    plain.score_batch([good], [plain[0]])  # a standard dataset's completions are strings: c[0] is a character
    assert plain.stats.errors == 1
    task.close()
    plain.close()


def test_a_function_gets_only_the_keywords_it_names(files: Path) -> None:
    data = standard_rows(files)
    only = rewarded(data, f"{files / 'ours.py'}:only_completions")
    assert only.score_batch(["abc", "de"], [only[0], only[1]]) == [3.0, 2.0]
    state = rewarded(data, f"{files / 'ours.py'}:ids_and_state")
    state.max_steps = 4
    assert state.score_logged(["x", "y"], [state[0]] * 2, [[1, 2, 3], [4]], step=2)[0] == [4023.0, 4021.0]
    assert only.stats.errors == state.stats.errors == 0
    only.close()
    state.close()


def test_log_metric_and_log_extra_come_back_from_the_worker(
    files: Path, caplog: pytest.LogCaptureFixture
) -> None:
    task = rewarded(standard_rows(files), f"{files / 'ours.py'}:logging_reward")
    assert task._process is not None  # it runs in the worker process
    with caplog.at_level(logging.WARNING):
        scores, logs = task.score_logged(["abcd", "ab"], [task[0], task[1]])
    assert scores == [1.0, 1.0]
    assert logs.metrics == {"mean_chars": [3.0]}
    assert logs.extras == {"chars": [4, 2]}
    assert "logged 1 values of column 'short' for 2 completions" in caplog.text
    task.close()


def test_a_raising_async_function_is_reported_like_a_raising_sync_one(
    files: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outcomes = []
    for name in ("sync_raises", "async_raises"):
        task = rewarded(standard_rows(files), f"{files / 'ours.py'}:{name}")
        with caplog.at_level(logging.WARNING):
            scores = task.score_batch(["fine", "boom", "ok"], [task[0]] * 3)
        s = task.stats
        outcomes.append((scores, s.calls, s.errors, s.timeouts, s.last_error.replace(name, "FN")))
        assert f"{name} raised ValueError: cannot score boom: its completions score 0" in caplog.text
        task.close()
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][:4] == ([1.0, 0.0, 1.0], 3, 1, 0)


def test_an_async_function_that_hangs_times_out(files: Path) -> None:
    task = rewarded(standard_rows(files), f"{files / 'ours.py'}:async_hangs", reward_timeout=0.3)
    assert task.score_batch(["a", "b"], [task[0]] * 2) == [0.0, 0.0]
    assert (task.stats.errors, task.stats.timeouts) == (0, 2)
    task.close()


def test_async_functions_are_awaited_together(files: Path) -> None:
    """Each waits for an event the other sets: only awaited together (as TRL gathers them) do both finish."""
    ours = files / "ours.py"
    task = rewarded(standard_rows(files), [f"{ours}:waits_for_second", f"{ours}:waits_for_first"])
    assert task.score_batch(["a", "b"], [task[0]] * 2) == [3.0, 3.0]
    assert (task.stats.errors, task.stats.timeouts) == (0, 0)
    task.close()
    alone = rewarded(standard_rows(files), f"{ours}:waits_for_second")  # nothing sets its event: 2 s, then 0
    assert alone.score_batch(["a"], [alone[0]]) == [0.0] and alone.stats.errors == 1
    alone.close()


def test_awaited_together_each_keeps_its_own_failures(files: Path) -> None:
    ours = files / "ours.py"
    task = rewarded(standard_rows(files), [f"{ours}:async_raises", f"{files / 'trl_docs.py'}:non_empty"])
    assert task.score_batch(["fine", "boom"], [task[0]] * 2) == [2.0, 1.0]  # boom's retry alone fails
    assert (task.stats.errors, task.stats.timeouts) == (1, 0)
    task.close()
    hung = rewarded(standard_rows(files), [f"{ours}:async_hangs", f"{ours}:async_raises"], reward_timeout=0.3)
    assert hung.score_batch(["a", "b"], [hung[0]] * 2) == [0.0, 0.0]
    assert hung.stats.timeouts == 4  # one overrun for the pair: each function's two completions count
    hung.close()


def verl_rows(tmp_path: Path) -> Path:
    """Rows in verl's data layout: data_source, chat prompt, reward_model.ground_truth, extra_info."""
    return write_rows(
        tmp_path / "verl.jsonl",
        [
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                "extra_info": {"index": i},
            }
            for i in (3, 4)
        ],
    )


def test_verl_compute_score_is_detected_and_called_per_completion(files: Path) -> None:
    data = verl_rows(files)
    task = rewarded(data, f"{files / 'ours.py'}:compute_score")  # the answer field found in verl's layout
    assert task.score_batch(["it is 6", "it is 7", "8"], [task[0], task[0], task[1]]) == [1.0, 0.0, 1.0]
    scores, logs = rewarded(
        data, f"{files / 'ours.py'}:compute_score_dict", answer_key="reward_model.ground_truth"
    ).score_logged(["= 6", "= 5"], [task[0]] * 2)
    assert scores == [1.0, 0.0]
    assert logs.metrics == {"acc": [1.0, 0.0]} and logs.extras == {
        "acc": [True, False],
        "pred": ["= 6", "= 5"],
    }
    task.close()


def test_reward_style_settings(files: Path) -> None:
    data = verl_rows(files)
    with pytest.raises(UserError, match=r"task\.reward_style='bogus'"):
        TaskConfig(reward_style="bogus")
    with pytest.raises(UserError, match=r"task\.reward_style=verl but reward function .*only_completions"):
        rewarded(data, f"{files / 'ours.py'}:only_completions", reward_style="verl")
    trl = rewarded(data, f"{files / 'ours.py'}:compute_score", reward_style="trl")  # verl's, called TRL's way
    assert trl.score_batch(["6"], [trl[0]]) == [0.0] and trl.stats.errors == 1
    trl.close()


def test_in_process_callables_take_every_style() -> None:
    """A lambda or local function (run in the trainer's process) is called the same ways."""
    seen: dict[str, object] = {}

    async def local(completions, log_metric):
        log_metric("n", len(completions))
        return [1.0] * len(completions)

    def verl_local(data_source, solution_str, ground_truth, extra_info):
        seen.update(truth=ground_truth, info=extra_info)
        return {"score": 0.5, "extra": 2}

    task = with_reward_fns(make_task(TaskConfig()), [local, verl_local])
    ex = task[0]
    scores, logs = task.score_logged(["a"], [ex])
    assert scores == [1.5] and logs.metrics == {"n": [1.0], "extra": [2.0]}
    assert seen == {"truth": ex.answer, "info": {}}


def test_in_process_async_functions_are_awaited_together() -> None:
    """Two local async functions (run in the trainer's process), each waiting for the other's event, both
    finish; a raising one keeps its failure to itself; one left alone waits in vain and scores 0."""
    import asyncio

    events: dict = {}

    def event(name: str) -> asyncio.Event:
        return events.setdefault((id(asyncio.get_running_loop()), name), asyncio.Event())

    async def first(completions, **kwargs):
        event("first").set()
        await asyncio.wait_for(event("second").wait(), 2)
        return [1.0] * len(completions)

    class Second:  # a callable object whose __call__ is async
        async def __call__(self, completions, **kwargs):
            event("second").set()
            await asyncio.wait_for(event("first").wait(), 2)
            return [2.0] * len(completions)

    async def raises(completions, **kwargs):
        raise ValueError("boom")

    task = with_reward_fns(make_task(TaskConfig(reward_timeout=5.0)), [first, Second(), raises])
    assert task.score_batch(["a", "b"], [task[0]] * 2) == [3.0, 3.0]
    assert (task.stats.errors, task.stats.timeouts) == (2, 0)  # `raises`, retried per completion
    alone = with_reward_fns(make_task(TaskConfig(reward_timeout=5.0)), [first])
    assert alone.score_batch(["a"], [alone[0]]) == [0.0] and alone.stats.errors == 1


def test_rewards_carry_their_logs_across_processes_and_batches() -> None:
    """What a reward function logged travels with its rewards: pickled (to and from a rollout worker) and cut
    per group when several groups were scored in one call (the metrics stay with the first)."""
    import pickle

    from sparserl.rollout.rewards import Rewards, RewardWorker
    from sparserl.tasks.reward_styles import RewardLogs

    got = Rewards([1.0, 0.0, 0.5], RewardLogs({"m": [2.0]}, {"c": ["a", "b", "c"]}))
    back = pickle.loads(pickle.dumps(got))
    assert back == [1.0, 0.0, 0.5] and back.logs == got.logs
    first, second = got.split([2, 1])
    assert (first, first.logs) == ([1.0, 0.0], RewardLogs({"m": [2.0]}, {"c": ["a", "b"]}))
    assert (second, second.logs) == ([0.5], RewardLogs({}, {"c": ["c"]}))

    def lengths(texts: list[str], examples: list, ids: list[list[int]]) -> Rewards:
        return Rewards(
            [float(len(i)) for i in ids], RewardLogs({"calls": [1.0]}, {"n": [len(i) for i in ids]})
        )

    worker = RewardWorker(asynchronous=False)  # both groups in one call, then cut
    worker.submit("g1", lengths, ["a", "b"], [None, None], [[1], [1, 2]])
    worker.submit("g2", lengths, ["c"], [None], [[1, 2, 3]])
    out = worker.wait()
    assert out == {"g1": [1.0, 2.0], "g2": [3.0]}
    assert out["g1"].logs == RewardLogs({"calls": [1.0]}, {"n": [1, 2]})
    assert out["g2"].logs == RewardLogs({}, {"n": [3]})
