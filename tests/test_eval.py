"""Evaluation: the pass@k estimator against hand values, dense vs sparse evaluation on a tiny model, and
loading models from run directories (exported model, full checkpoint, LoRA adapter checkpoint)."""

from __future__ import annotations

import json
import math
import os
from itertools import combinations
from pathlib import Path

import pytest
import torch

from sparserl.config import ConfigError, load_config, save_config
from sparserl.engine import KVConfig
from sparserl.errors import UserError
from sparserl.eval import evaluate, load_eval_model, load_eval_task, pass_at_k, pass_ks, summarize_rewards
from sparserl.eval.loading import eval_task_config
from sparserl.models import ModelLoadError, tiny_model
from sparserl.tasks import Example, Task, TaskConfig
from tests.shared_data import DATA

# ------------------------------------------------------------------------------------------------ pass@k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2)
        (10, 3, 1, 0.3),
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
        (4, 2, 3, 1.0),  # n - c < k: some draw must be correct
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_subset_probability() -> None:
    """Brute force: the share of k-subsets of n samples (c correct) holding a correct one."""
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_summarize_rewards_hand_values() -> None:
    out = summarize_rewards([[1, 0, 0, 0], [1, 1, 0, 0]])
    assert pass_ks(4) == [1, 2, 4]
    assert pass_ks(6) == [1, 2, 4, 6]
    assert set(out) == {"mean@4", "pass@1", "pass@2", "pass@4"}
    assert out["mean@4"] == pytest.approx(0.375)
    assert out["pass@1"] == pytest.approx(0.375)
    assert out["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert out["pass@4"] == pytest.approx(1.0)
    # partial rewards count in mean@k but a sample passes only at the threshold
    partial = summarize_rewards([[0.5, 1.0]])
    assert partial["mean@2"] == pytest.approx(0.75) and partial["pass@1"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same number"):
        summarize_rewards([[1, 0], [1]])


# --------------------------------------------------------------------------------------- evaluate()


class FirstByteTask(Task):
    """Reward 1 when the completion's first character has an even code: varies on a random tiny model."""

    name = "first-byte"

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> Example:
        return Example([{"role": "user", "content": f"Tell me about the number {i * 7}."}], str(i))

    def reward(self, completion_text: str, example: Example) -> float:
        return float(bool(completion_text) and ord(completion_text[0]) % 2 == 0)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


def test_evaluate_reports_dense_and_sparse(tiny) -> None:
    model, tok = tiny
    kv = KVConfig(method="rkv", budget=24, window=4, interval=4)
    out = evaluate(model, tok, FirstByteTask(), kv=kv, samples=3, limit=4, max_new_tokens=24, batch_prompts=3)
    assert out["prompts"] == 4 and out["samples"] == 3 and out["kv"]["method"] == "rkv"
    for mode in ("dense", "sparse"):
        sec = out[mode]
        for key in (
            "mean@3",
            "pass@1",
            "pass@2",
            "pass@3",
            "mean_length",
            "truncated_share",
            "peak_kv_bytes",
            "retained_fraction",
            "tokens_per_s",
        ):
            assert key in sec, (mode, key)
        assert 0.0 <= sec["mean@3"] <= sec["pass@3"] <= 1.0
        assert sec["pass@1"] == pytest.approx(sec["mean@3"])  # binary reward: pass@1 is the mean
        assert 0.0 <= sec["truncated_share"] <= 1.0 and 1 <= sec["mean_length"] <= 24
    assert out["dense"]["retained_fraction"] == 1.0 and out["dense"]["compression_events"] == 0
    assert out["sparse"]["compression_events"] > 0 and out["sparse"]["retained_fraction"] < 1.0
    assert out["sparse"]["peak_kv_bytes"] < out["dense"]["peak_kv_bytes"]
    assert out["sparse_minus_dense"]["mean@3"] == pytest.approx(
        out["sparse"]["mean@3"] - out["dense"]["mean@3"]
    )
    assert "examples" not in out
    json.dumps(out)  # JSON-ready


def test_dense_and_sparse_share_prompts_and_seeds(tiny) -> None:
    """With a budget that is never reached, sparse inference must reproduce dense inference exactly."""
    model, tok = tiny
    kv = KVConfig(method="snapkv", budget=4000, window=4, interval=4)
    out = evaluate(model, tok, FirstByteTask(), kv=kv, samples=4, max_new_tokens=16, details=True)
    assert out["sparse"]["compression_events"] == 0
    for ex in out["examples"]:
        assert ex["dense"]["rewards"] == ex["sparse"]["rewards"]
        assert ex["dense"]["lengths"] == ex["sparse"]["lengths"]
        assert ex["dense"]["completions"] == ex["sparse"]["completions"]
    assert len({tuple(ex["dense"]["rewards"]) for ex in out["examples"]}) > 1  # the reward does vary
    # and a different seed gives different samples (the seed reaches the sampler)
    other = evaluate(model, tok, FirstByteTask(), kv=kv, samples=4, max_new_tokens=16, seed=1, details=True)
    assert [e["dense"]["completions"] for e in other["examples"]] != [
        e["dense"]["completions"] for e in out["examples"]
    ]


def test_evaluate_examples_list_and_modes(tiny) -> None:
    model, tok = tiny
    examples = [Example([{"role": "user", "content": "What is 1 + 1?"}], "2")]
    dense_only = evaluate(model, tok, examples, kv=None, samples=2, max_new_tokens=8)
    assert "dense" in dense_only and "sparse" not in dense_only and dense_only["kv"] is None
    assert dense_only["dense"]["mean@2"] == 0.0  # a random model does not answer \boxed{2}
    sparse_only = evaluate(
        model, tok, examples, kv=KVConfig(method="h2o", budget=16, window=4), dense=False, max_new_tokens=8
    )
    assert "dense" not in sparse_only and "sparse" in sparse_only
    with pytest.raises(ValueError, match="nothing to evaluate"):
        evaluate(model, tok, examples, kv=KVConfig(method="dense"), dense=False)
    with pytest.raises(ValueError, match="samples"):
        evaluate(model, tok, examples, samples=0)


# ------------------------------------------------------------------------------------ data and models


def test_eval_task_config_sources(tmp_path: Path) -> None:
    assert eval_task_config("arithmetic").name == "arithmetic"
    assert eval_task_config("long_arithmetic").split == "test"
    f = tmp_path / "arithmetic.jsonl"  # a file named like a built-in task is read as a file
    f.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    cfg = eval_task_config(str(f))
    assert cfg.data == str(f) and cfg.format_weight == 0.0
    task = load_eval_task(str(f))
    assert len(task) == 1 and task[0].answer == "2"
    # a run's task lends its prompt format and procedural settings, not its data source or field mapping
    run_task = TaskConfig(
        name="train",
        data="train.jsonl",
        question_key="prompt",
        answer_key="label",
        instruction="Answer in \\boxed{}.",
        max_digits=4,
        max_examples=10,
        format_weight=0.5,
    )
    cfg = eval_task_config(str(f), base=run_task)
    assert (cfg.data, cfg.question_key, cfg.answer_key, cfg.max_examples) == (str(f), "", "", 0)
    assert cfg.instruction == "Answer in \\boxed{}." and cfg.format_weight == 0.0
    cfg = eval_task_config("arithmetic", base=run_task)
    assert cfg.data == "" and cfg.max_digits == 4
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        eval_task_config(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="--data is required"):
        load_eval_task(None, model_spec="smollm2-135m")


def test_named_eval_sets_resolve_in_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--data aime24` / `gsm8k` are the files of the folders $SPARSERL_DATA_DIR names, searched in order;
    unset, an eval set is an error that names the variable, and so is a named folder that does not exist."""
    monkeypatch.delenv("SPARSERL_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match=r"SPARSERL_DATA_DIR.*eval/aime24\.jsonl"):
        eval_task_config("aime24")
    assert eval_task_config("gsm8k").data == ""  # the Hub's openai/gsm8k
    first, second = tmp_path / "a", tmp_path / "b"
    (second / "eval").mkdir(parents=True)
    (second / "eval" / "aime24.jsonl").write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    (first / "gsm8k").mkdir(parents=True)
    (first / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "1 + 2?", "answer": "#### 3"}) + "\n")
    monkeypatch.setenv("SPARSERL_DATA_DIR", f"{first}{os.pathsep}{second}")
    assert eval_task_config("aime24").data == str(second / "eval" / "aime24.jsonl")
    assert eval_task_config("gsm8k").data == str(first / "gsm8k" / "test.jsonl")
    assert load_eval_task("aime24")[0].answer == "2"
    monkeypatch.setenv("SPARSERL_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=r"SPARSERL_DATA_DIR names .*nowhere, which is not a folder"):
        eval_task_config("gsm8k")


@pytest.mark.shared_data
def test_named_eval_sets_resolve_to_shared_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSERL_DATA_DIR", str(DATA))
    gsm = eval_task_config("gsm8k")
    assert gsm.data.endswith("gsm8k/test.jsonl")
    assert load_eval_task("aime24")[0].answer == "204"
    assert len(load_eval_task(str(DATA / "eval" / "amc23.jsonl"))) == 40


def _tiny_dir(root: Path, seed: int = 0) -> Path:
    model, tok = tiny_model(seed=seed)
    path = root / f"tiny-{seed}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _logits(model, ids=(3, 40, 50, 60)) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits


def _fake_run(root: Path, base: Path, *overrides: str) -> tuple[Path, object]:
    """A run directory as the trainer writes it: config.yaml and one checkpoint of the given weights."""
    from sparserl.trainer import save_checkpoint
    from sparserl.trainer.checkpoint import TrainerState
    from sparserl.trainer.policy import Policy

    run = root / "run"
    cfg = load_config(None, [f"model.spec={base}", "model.device=cpu", *overrides])  # CPU-built references
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    policy = Policy(cfg.model, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():  # "training": move every trainable weight, so the checkpoint differs from the base
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    opt = torch.optim.SGD(policy.trainable_parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    save_checkpoint(run, TrainerState(step=3), policy.weights(), opt, sched, 2, policy.weights_name)
    return run, policy


def test_load_model_from_run_checkpoint_and_final(tmp_path: Path) -> None:
    base = _tiny_dir(tmp_path)
    run, policy = _fake_run(tmp_path, base)
    want = _logits(policy.module)
    loaded = load_eval_model(str(run))
    assert loaded.kind == "run-checkpoint" and loaded.path.endswith("step-000003")
    assert torch.allclose(_logits(loaded.model), want, atol=1e-5)
    assert not torch.allclose(_logits(load_eval_model(str(base)).model), want, atol=1e-3)
    ckpt = load_eval_model(str(run / "checkpoints" / "step-000003"))  # a checkpoint directory directly
    assert torch.allclose(_logits(ckpt.model), want, atol=1e-5)
    # once the run has exported final/, that is what a run directory means (unless use_checkpoint)
    policy.export(run / "final")
    final = load_eval_model(str(run))
    assert final.kind == "run-final" and torch.allclose(_logits(final.model), want, atol=1e-5)
    assert load_eval_model(str(run), use_checkpoint=True).kind == "run-checkpoint"


def test_load_lora_run_checkpoint(tmp_path: Path) -> None:
    base = _tiny_dir(tmp_path)
    run, policy = _fake_run(tmp_path, base, "model.lora=true", "model.lora_r=2")
    assert policy.weights_name == "adapter.safetensors"
    want = _logits(policy.peft)
    loaded = load_eval_model(str(run))
    assert loaded.kind == "run-checkpoint" and loaded.info["lora"] is True
    assert not hasattr(loaded.model, "peft_config")  # merged: a plain model for the engine
    assert torch.allclose(_logits(loaded.model), want, atol=1e-5)
    assert not torch.allclose(_logits(load_eval_model(str(base)).model), want, atol=1e-3)


def test_load_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_eval_model(str(tmp_path / "no-such-model"))
    run = tmp_path / "empty-run"
    run.mkdir()
    save_config(load_config(None, ["model.spec=tiny-llama"]), run / "config.yaml")
    with pytest.raises(FileNotFoundError, match="neither an exported model"):
        load_eval_model(str(run))
