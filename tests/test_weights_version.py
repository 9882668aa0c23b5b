"""The packed weight copy (engine/weights.py) is kept between `generate` calls while the model's weights version
stands: rebuilt exactly when the version, the LoRA merge state or a weight tensor moves, and never stale after
an optimizer step (eager and compiled)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_compile import needs_compiler
from test_trainer import make_trainer, tiny_cfg

from sparserl.engine import KVConfig, RolloutEngine, score
from sparserl.engine import weights as packing
from sparserl.models import tiny_model
from sparserl.trainer import update

PROMPTS = [[5, 17, 40, 3], [9, 2, 77]]


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts `PackedProjections.build` calls."""
    calls: list[int] = []
    real = packing.PackedProjections.build.__func__

    def counted(cls, *a, **k):
        calls.append(1)
        return real(cls, *a, **k)

    monkeypatch.setattr(packing.PackedProjections, "build", classmethod(counted))
    return calls


def _gen(engine: RolloutEngine, seed: int = 0):
    return engine.generate(PROMPTS, n=2, max_new_tokens=6, seed=seed)


def _gap_to_scorer(model, out) -> float:
    """Max |sampler log-prob - the model's own forward's| over the samples (1e-5 when the sampler read the
    current weights, 1e-2 or more when it read old ones)."""
    prompts = [PROMPTS[s.prompt_index] for s in out]
    dense = score(model, prompts, [s.completion_ids for s in out])
    return max(float((s.logprobs - d).abs().max()) for s, d in zip(out, dense, strict=True))


def test_untracked_model_repacks_every_call(builds: list[int]) -> None:
    model, tok = tiny_model("llama")
    engine = RolloutEngine(model, tok)
    _gen(engine)
    _gen(engine)
    assert len(builds) == 2  # nobody promised to bump a version: today's behaviour, always correct


def test_repacks_exactly_when_the_version_moves(builds: list[int]) -> None:
    model, tok = tiny_model("llama")
    fresh, _ = tiny_model("llama")  # the same weights, untracked: repacks every call
    packing.track_weights_version(model)
    dense, evicting = (
        RolloutEngine(model, tok),
        RolloutEngine(model, tok, KVConfig(method="rkv", budget=6, window=2, interval=2)),
    )
    first = _gen(dense)
    _gen(dense, seed=1)
    _gen(evicting)  # another engine over the same model and dtype shares the copy
    assert len(builds) == 1
    packing.bump_weights_version(model)
    assert len(builds) == 1  # the bump itself builds nothing (and frees the stale copy)
    again = _gen(dense)
    assert len(builds) == 2
    ref = _gen(RolloutEngine(fresh, tok))  # builds its own copy
    assert len(builds) == 3
    for a, b, c in zip(first, again, ref, strict=True):
        assert a.completion_ids == b.completion_ids == c.completion_ids
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.logprobs, c.logprobs)
    # an in-place change autograd sees (its version counter moves) repacks without a bump
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    _gen(dense)
    assert len(builds) == 4
    # so does a weight replaced by another tensor
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    _gen(dense)
    assert len(builds) == 5
    assert _gap_to_scorer(model, _gen(dense)) < 1e-4 and len(builds) == 5


def test_the_lora_merge_state_is_part_of_the_key(builds: list[int]) -> None:
    """Which adapters are active (the sparse-path switch, the reference's disabled adapters) selects the copy."""
    from peft import LoraConfig, get_peft_model

    model, tok = tiny_model("llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    peft = get_peft_model(model, cfg, adapter_name="default")
    peft.add_adapter("other", cfg)
    lm = peft.get_base_model()
    with torch.no_grad():  # non-zero B matrices: the adapters change the outputs
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    packing.track_weights_version(peft)
    engine = RolloutEngine(lm, tok)
    states = []
    for step in ("default", "default", "other", "off", "off", "default"):
        if step == "off":
            peft.base_model.disable_adapter_layers()
        else:
            peft.base_model.enable_adapter_layers()
            peft.base_model.set_adapter(step)
        out = _gen(engine)
        assert _gap_to_scorer(lm, out) < 1e-4, step  # the copy matches what the model's forward runs
        states.append(len(builds))
    assert states == [1, 1, 2, 3, 3, 4]


def _stale_gap(tmp_path: Path, *extra: str, name: str) -> float:
    """One training step on a tiny model (fused AdamW, large lr), then the engine's gap to the scorer."""
    cfg = tiny_cfg(tmp_path, "algo.preset=dense", "optim.lr=0.05", "optim.grad_clip=0", *extra, name=name)
    trainer = make_trainer(cfg)
    assert trainer.learner.optimizer.defaults["fused"]  # the optimizer that bumps no version counter
    batch, _ = trainer.rollout(1)
    assert _gap_to_scorer(trainer.policy.module, _gen(trainer.rollouts.backend.engine)) < 1e-4
    trainer.learn(1, batch)
    gap = _gap_to_scorer(trainer.policy.module, _gen(trainer.rollouts.backend.engine))
    trainer.close()
    return gap


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=needs_compiler)])
def test_no_stale_copy_after_an_optimizer_step(
    tmp_path: Path, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = ("engine.compile=true",) if compiled else ()
    assert _stale_gap(tmp_path, *extra, name="bumped") < 1e-4
    # the check can fail: without the learner's bump the engine samples from the previous weights
    monkeypatch.setattr(update, "bump_weights_version", lambda module: None)
    assert _stale_gap(tmp_path, *extra, name="not_bumped") > 1e-3


def test_packed_copy_counts_its_own_bytes() -> None:
    """`nbytes` is the packed matrices' bytes: every projection and the head, each [in, out], once."""
    model, _ = tiny_model("llama")
    layers = model.model.layers
    packed = packing.PackedProjections.build(layers, model.lm_head, torch.float32)
    linears = [m for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    want = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in linears)
    want += model.lm_head.weight.numel()
    assert packed.nbytes() == 4 * want
