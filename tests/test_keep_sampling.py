"""DeepSeek-V3.2's keep-sampling mask: the kept sets' bits, the learner's log-probs over them (values and
gradients against the unchunked formula), and a training step whose dense sampler truncates with top-k: pi_old
renormalised over the recorded kept sets is the sampler's own log-prob, where the full softmax is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer, tiny_cfg

from sparserl.algo.keep_sampling import (
    keep_sampling_logprobs,
    kept_set_metrics,
    pack_kept,
    padded_kept,
    unpack_kept,
)
from sparserl.config import ConfigError
from sparserl.engine import score
from sparserl.engine.chunked_head import target_logprobs

DENSE_TOP_K = ["algo.preset=dense", "algo.correction_mode=decoupled", "kv.method=dense", "rollout.top_k=3"]


@pytest.mark.parametrize("vocab", [13, 16])
def test_kept_sets_pack_to_bits_and_back(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    kept = torch.rand(3, 5, vocab, generator=gen) < 0.3
    logp = torch.zeros(3, 5, vocab).masked_fill(~kept, float("-inf"))
    packed = pack_kept(logp)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, (vocab + 7) // 8)
    assert torch.equal(unpack_kept(packed, vocab), kept)
    mask = torch.ones(3, 5, dtype=torch.bool)
    sizes = kept.sum(-1).float()
    got = kept_set_metrics(packed, mask)
    assert got["keep_sampling/kept_tokens_mean"] == pytest.approx(float(sizes.mean()))
    assert got["keep_sampling/single_token_frac"] == pytest.approx(float((sizes == 1).float().mean()))


def test_padded_kept_keeps_every_id_past_a_samples_end() -> None:
    rows = [torch.tensor([[1], [2]], dtype=torch.uint8), torch.tensor([[4]], dtype=torch.uint8)]
    out = padded_kept(rows, [2, 1], 3)
    assert out[:, :, 0].tolist() == [[1, 2, 255], [4, 255, 255]]
    with pytest.raises(RuntimeError, match="sample 1: 1 kept sets for 2 tokens"):
        padded_kept(rows, [2, 2], 3)


def test_learner_logprobs_and_gradient_over_the_kept_set() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, temperature = 13, 0.7
    logits = torch.randn(2, 4, vocab, generator=gen)
    kept = torch.rand(2, 4, vocab, generator=gen) < 0.5
    targets = torch.randint(vocab, (2, 4), generator=gen)
    kept.scatter_(-1, targets[..., None], True)  # the drawn token is always kept
    bits = pack_kept(torch.zeros(2, 4, vocab).masked_fill(~kept, float("-inf")))
    want = keep_sampling_logprobs(logits / temperature, kept, targets)
    # by hand at one position: log p(o) - log sum over the kept ids of p
    row = (logits[0, 0] / temperature).log_softmax(-1)
    hand = row[targets[0, 0]] - row[kept[0, 0]].logsumexp(-1)
    assert want[0, 0].item() == pytest.approx(hand.item(), abs=1e-6)
    assert torch.allclose(target_logprobs(logits, targets, temperature, bits), want, atol=1e-6)

    from sparserl.engine.chunked_head import head_logprobs

    class Identity(torch.nn.Linear):  # a head whose logits are its input: the gradient lands on the logits
        def forward(self, x):
            return x

    weights = torch.randn(2, 4, generator=gen)
    a = logits.clone().requires_grad_()
    (head_logprobs(Identity(1, 1), a, targets, temperature, bits) * weights).sum().backward()
    b = logits.clone().requires_grad_()
    (keep_sampling_logprobs(b / temperature, kept, targets) * weights).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert (a.grad[~kept] == 0).all()


def test_truncated_sampling_needs_the_mask() -> None:
    with pytest.raises(ConfigError, match="algo.keep_sampling_mask=true"):
        tiny_cfg(Path("/nonexistent"), *DENSE_TOP_K[:-1], "rollout.top_k=3", "algo.keep_sampling_mask=false")
    with pytest.raises(ConfigError, match="algo.keep_sampling_mask"):
        tiny_cfg(Path("/nonexistent"), "algo.keep_sampling_mask=true", "rollout.top_p=0.9",
                 "rollout.partial.enable=true", "rollout.kv_memory_cap=64MiB")  # fmt: skip


def test_a_truncating_dense_sampler_matches_pi_old_over_its_kept_sets(tmp_path: Path) -> None:
    # one mini-batch: the update's only pass has pi_theta = pi_old, recomputed apart (not taken from that pass)
    one_pass = ["optim.mini_batch_size=8", "trainer.reuse_learner_logprobs=false"]
    trainer = make_trainer(tiny_cfg(tmp_path, *DENSE_TOP_K, "algo.keep_sampling_mask=true", *one_pass))
    batch, metrics = trainer.rollout(1)
    assert batch.kept is not None and batch.logp_old is not None
    assert metrics["keep_sampling/kept_tokens_mean"] == pytest.approx(3.0)
    kept = unpack_kept(batch.kept, trainer.policy.module.lm_head.out_features)
    tokens = torch.zeros_like(batch.mask, dtype=torch.long)
    for i, c in enumerate(batch.completions):
        tokens[i, : len(c)] = torch.tensor(c)
    assert kept.gather(-1, tokens[..., None]).squeeze(-1)[batch.mask].all()  # every drawn token was kept
    m = batch.mask
    gap = (batch.logp_old - batch.logp_sampler)[m].abs().max().item()
    assert gap < 1e-5  # renormalised pi_old is what the sampler drew from (fp32, same weights)
    full = score(trainer.policy.module, batch.prompts, batch.completions, temperature=1.0)
    full_gap = torch.cat([f - s[: len(f)] for f, s in zip(full, batch.logp_sampler, strict=True)])
    assert (
        full_gap.max().item() < 1e-6 and full_gap.min().item() < -1e-3
    )  # the full softmax: the kept mass' log
    before = {k: v.clone() for k, v in trainer.policy.weights().items()}
    out = trainer.learn(1, batch)
    assert out["train/nonfinite_skipped_updates"] == 0
    assert out["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the learner renormalises too
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.weights().items())
    trainer.close()


def test_sparserl_bias_refuses_a_truncating_sampler(tmp_path: Path) -> None:
    from sparserl.errors import UserError
    from sparserl.eval.bias_command import BiasSettings, measure

    cfg = tiny_cfg(tmp_path, "algo.keep_sampling_mask=true", "rollout.top_p=0.9")
    with pytest.raises(UserError, match="sparserl bias: rollout.top_p=0.9"):
        measure(cfg, BiasSettings(), tmp_path / "bias")
    assert not (tmp_path / "bias").exists()


@pytest.mark.parametrize(
    "extra",
    [["rollout.overlap.enable=true"], ["rollout.kv_memory_cap=64KiB"]],
    ids=["overlap", "kv-cap"],
)
def test_the_mask_trains_with_overlap_and_under_a_kv_cap(tmp_path: Path, extra: list[str]) -> None:
    """Two steps with an R-KV sampler truncating at top-p 0.9: drawn ahead of the update, or preempted and
    re-prefilled under a cap, every trained token's kept set was recorded (a padded one would count the whole
    vocabulary) and the updates stay finite."""
    cfg = tiny_cfg(tmp_path, "algo.keep_sampling_mask=true", "rollout.top_p=0.9", "trainer.steps=2", *extra)
    trainer = make_trainer(cfg)
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "keep_sampling/kept_tokens_mean" in r]
    vocab = trainer.policy.module.lm_head.out_features
    assert len(steps) == 2 and all(1 <= r["keep_sampling/kept_tokens_mean"] < vocab for r in steps)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["nonfinite_skipped_updates"] == 0
    trainer.close()


def test_ray_rollout_workers_refuse_the_mask_before_anything_loads(tmp_path: Path) -> None:
    from sparserl.rollout.build import check_rollout

    cfg = tiny_cfg(
        tmp_path, "algo.keep_sampling_mask=true", "rollout.top_k=5", "distributed.rollout_workers=1"
    )
    with pytest.raises(ConfigError, match="cannot run with algo.keep_sampling_mask: it does not record"):
        check_rollout(cfg)
    check_rollout(
        tiny_cfg(tmp_path, "algo.keep_sampling_mask=true", "distributed.rollout_workers=1")
    )  # no cut
