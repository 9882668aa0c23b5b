"""The engine's small shared helpers: right padding, a module's mode for a block, whether prompts fit the
context, and the generate-and-score loop that training-time evaluation and `sparserl eval` share."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparserl.engine import RolloutEngine
from sparserl.engine.cache import dense_kv_bytes
from sparserl.engine.context_length import prompt_fits, split_by_fit, too_long_message
from sparserl.engine.module_mode import module_mode
from sparserl.engine.padding import right_pad
from sparserl.engine.scored import generate_and_score
from sparserl.models import encode_prompt, tiny_model
from sparserl.tasks import TaskConfig, make_task


def test_right_pad():
    values, mask = right_pad([[1, 2, 3], [], [4]], value=9)
    assert values.tolist() == [[1, 2, 3], [9, 9, 9], [4, 9, 9]] and values.dtype == torch.long
    assert mask.tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    cut, cut_mask = right_pad([torch.tensor([0.5, 1.5, 2.5]), [1.0]], torch.float32, width=2)
    assert cut.tolist() == [[0.5, 1.5], [1.0, 0.0]] and cut_mask.tolist() == [[True, True], [True, False]]
    assert right_pad([])[0].shape == (0, 0)


def test_module_mode_restores_the_mode_even_on_error():
    model = nn.Dropout(0.5).train()
    with module_mode(model, training=False):
        assert not model.training
    assert model.training
    model.eval()
    with pytest.raises(RuntimeError), module_mode(model, training=True):
        assert model.training
        raise RuntimeError
    assert not model.training


def test_prompt_fit_rules():
    assert prompt_fits(10, 6, 16) and not prompt_fits(11, 6, 16) and prompt_fits(10**6, 6, None)
    lengths = {0: 3, 1: 20, 2: 4, 3: 30, 4: 5}
    assert split_by_fit(range(5), lengths.__getitem__, 6, 16) == ([0, 2, 4], [1, 3])
    assert split_by_fit(range(5), lengths.__getitem__, 6, 16, want=2) == ([0, 2], [1])
    message = too_long_message([1, 3, 5, 7], lambda i: f"d.jsonl:{i}", 6, 16, "rollout.max_new_tokens")
    assert message == (
        "4 prompt(s) longer than 10 tokens (the model's 16 positions minus rollout.max_new_tokens=6): "
        "d.jsonl:1, d.jsonl:3, d.jsonl:5 and 1 more"
    )
    assert dense_kv_bytes(8.0, 3, [[1, 2], [1, 2, 3, 4]], 6) == 8.0 * 3 * 10


def test_generate_and_score_pairs_each_sample_with_its_row():
    model, tok = tiny_model()
    task = make_task(TaskConfig(), "test")
    rows = [4, 1]
    prompts = [encode_prompt(tok, task[r].messages) for r in rows]
    engine = RolloutEngine(model, tok)
    sampling = {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop": None}
    seen = []

    def reward(texts, examples):
        seen.append((texts, examples))
        return [float(len(t)) for t in texts]

    scored = generate_and_score(
        engine, tok, task, rows, prompts, sampling, 7, reward, n=2, sample_keys=[3, 2, 1, 0]
    )
    direct = engine.generate(prompts, n=2, seed=7, sample_keys=[3, 2, 1, 0], **sampling)
    assert [s.completion_ids for s in scored.samples] == [s.completion_ids for s in direct]
    assert scored.examples == [task[4], task[4], task[1], task[1]]
    assert scored.texts == tok.batch_decode([s.completion_ids for s in direct], skip_special_tokens=True)
    assert scored.rewards == [float(len(t)) for t in scored.texts] and seen == [
        (scored.texts, scored.examples)
    ]
    assert scored.lengths == [len(s.completion_ids) for s in direct]
