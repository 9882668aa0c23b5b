"""SAPO on a local Ray: a node that only publishes trains exactly as a single node; drawn groups are kept whole
with ratio 1 (or the sender's log-probs), re-tokenised when the sender's tokenizer differs, their rewards
recomputed here and their origin recorded."""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

from tests.ray_cluster import local_ray, ray_cpus_free  # noqa: E402, F401 - the module's local Ray
from tests.test_trainer import make_trainer, tiny_cfg, weights  # noqa: E402


def node(tmp_path, name: str, pool: str, *extra: str):
    return make_trainer(tiny_cfg(tmp_path, "distributed.swarm.enable=true", f"distributed.swarm.pool={pool}",
                                 *extra, name=name))  # fmt: skip


def test_a_node_that_draws_nothing_trains_as_a_single_node(tmp_path):
    alone = make_trainer(tiny_cfg(tmp_path, "trainer.steps=2", name="alone"))
    alone.train()
    swarm = node(tmp_path, "node0", "p0", "trainer.steps=2")
    swarm.train()
    a, b = weights(alone), weights(swarm)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert ray.get(swarm.source.inner.pool.publish.remote(9, [])) == 4  # 2 steps x 2 groups published


@pytest.mark.parametrize("correction", ["ratio1", "sender_logp"])
def test_drawn_groups_are_trained_whole_with_their_origin(tmp_path, correction):
    pool = f"p-{correction}"
    sender = node(tmp_path, "sender", pool, "trainer.steps=1")
    sender.train()
    published = ray.get(sender.source.inner.pool.draw.remote(1, 2, 64, 0))
    receiver = node(tmp_path, "receiver", pool, "distributed.swarm.node=1", "distributed.swarm.shared_groups=2",
                    f"distributed.swarm.correction={correction}")  # fmt: skip
    batch, metrics = receiver.rollout(1)
    assert metrics["sampling/swarm_external_groups"] == 2 and len(batch.completions) == 16
    external = batch.completions[8:]
    sent = sorted(tuple(s["tokens"]) for g in published for s in g["samples"])
    assert sorted(map(tuple, external)) == sent  # taken as they are (same tokenizer), decoded by no one here
    if correction == "sender_logp":
        sent_logps = sorted(sum(s["logps"]) for g in published for s in g["samples"])
        got = sorted(
            float(row[m].sum()) for row, m in zip(batch.logp_sampler[8:], batch.mask[8:], strict=True)
        )
        assert got == pytest.approx(sent_logps, abs=1e-5)
    else:  # ratio 1: this node's dense log-probs now
        old = receiver._score(receiver.policy.module, batch.prompts[8:], external, batch.mask.shape[1])
        torch.testing.assert_close(
            batch.logp_sampler[8:][batch.mask[8:]], old[batch.mask[8:]], atol=1e-5, rtol=0
        )


def test_a_group_from_another_tokenizer_is_retokenised_from_its_text(tmp_path):
    receiver = node(tmp_path, "r", "p-text", "distributed.swarm.node=1", "distributed.swarm.shared_groups=1")
    text = "hello world"
    group = {"row": 3, "tokenizer": "other:1", "samples": [{"tokens": [1], "text": text, "logps": [-1.0],
                                                            "finish": "stop"}] * 4}  # fmt: skip
    ray.get(receiver.source.inner.pool.publish.remote(0, [group]))
    batch, metrics = receiver.rollout(1)
    assert metrics["sampling/swarm_retokenised_groups"] == 1
    assert batch.completions[-1] == receiver.tokenizer.encode(text, add_special_tokens=False)
