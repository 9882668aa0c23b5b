"""A code review's fixes: truncated sampling refused in training, APRIL train_all without
corrections warned about, a horizon-shaped lr schedule kept on resume, multi-byte stop strings, per-token
clamping before sequence-level rejection, RoPE in float32 unchanged by the rotation's dtype logic."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_engine import no_eos, prompts_of

from sparserl.algo import AlgoConfig, correction_weights
from sparserl.config import ConfigError, load_config
from sparserl.engine import RolloutEngine
from sparserl.engine.decoder import Decoder, rotate_half
from sparserl.models import tiny_model
from sparserl.trainer.run_dir import check_resume_changes

# ---------------------------------------------------------------- config


@pytest.mark.parametrize("override", ["rollout.top_p=0.9", "rollout.top_k=5"])
def test_truncated_sampling_is_refused_in_training(override: str) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.top_p=.*rollout\.top_k=.*full softmax"):
        load_config(None, [override])


def test_april_train_all_without_corrections_warns() -> None:
    on = ["rollout.partial.enable=true", "rollout.kv_memory_cap=64MiB"]
    with pytest.warns(UserWarning, match="train_all with algo.correction_mode=none"):
        load_config(None, [*on, "algo.preset=dense", "kv.method=dense"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_config(None, [*on, "algo.preset=dense", "kv.method=dense", "rollout.partial.mode=mask_old"])
        load_config(None, on)  # the default preset corrects (decoupled)
    assert not [w for w in seen if "train_all" in str(w.message)]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_resume_refuses_new_steps_under_a_horizon_schedule(schedule: str) -> None:
    saved = load_config(None, [f"optim.schedule={schedule}", "trainer.steps=4"])
    with pytest.raises(ConfigError, match=rf"trainer\.steps .*optim\.schedule='{schedule}'"):
        check_resume_changes(saved, load_config(None, [f"optim.schedule={schedule}", "trainer.steps=8"]))
    check_resume_changes(saved, load_config(None, [f"optim.schedule={schedule}", "trainer.steps=4"]))


def test_resume_may_change_steps_under_a_constant_schedule() -> None:
    saved = load_config(None, ["optim.schedule=constant", "trainer.steps=4"])
    check_resume_changes(saved, load_config(None, ["optim.schedule=constant", "trainer.steps=8"]))


# ---------------------------------------------------------------- stop strings


def test_a_stop_string_of_multi_byte_characters_fires() -> None:
    """The byte tokenizer spells each CJK character in three tokens; a two-character stop string is six."""
    model, tok = tiny_model("llama", seed=0)
    engine = no_eos(RolloutEngine(model, tok))
    script = tok.encode("ab日本cdefgh", add_special_tokens=False)
    assert len(tok.encode("日本", add_special_tokens=False)) == 6
    calls = []
    real = engine.decoder.logits

    def scripted(hidden: torch.Tensor) -> torch.Tensor:
        logits = real(hidden)
        forced = torch.full_like(logits, -1e4)
        forced[:, script[min(len(calls), len(script) - 1)]] = 0.0
        calls.append(1)
        return forced

    engine.decoder.logits = scripted
    out = engine.generate([prompts_of(tok)[0]], max_new_tokens=len(script), temperature=0, stop=["日本"])[0]
    assert out.finish_reason == "stop"
    assert tok.decode(out.completion_ids) == "ab日本"


# ---------------------------------------------------------------- corrections


def test_sequence_rejection_clamps_each_token_log_ratio_first() -> None:
    """verl and sparse-rl.md section 3: a token's log-ratio is clamped to [-20, 20] before the sequence sums
    or averages, so one token at -30 weighs like one at -20."""
    samp = torch.full((1, 4), -1.0, dtype=torch.float64)
    old = samp + torch.tensor([[-30.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    geo = AlgoConfig(correction_mode="decoupled", geo_rs_low=math.exp(-6), geo_rs_high=math.exp(6))
    _, keep, m = correction_weights(old, samp, mask, geo)
    assert keep.all() and m["rollout_corr/geo_rs_rejected_fraction"] == 0.0  # mean -5, not -7.5
    mis = AlgoConfig(correction_mode="decoupled", seq_mis_low=math.exp(-25))
    w, keep, m = correction_weights(old, samp, mask, mis)
    assert keep.all() and m["rollout_corr/seq_mis_rejected_fraction"] == 0.0  # sum -20, not -30
    assert w[0, 1].item() == pytest.approx(math.exp(-20))
    strict = AlgoConfig(correction_mode="decoupled", geo_rs_low=math.exp(-4))
    assert not correction_weights(old, samp, mask, strict)[1].any()  # -5 is still outside exp(-4)


# ---------------------------------------------------------------- RoPE in the bfloat16 sampler


def test_float32_rope_is_the_plain_formula_bit_for_bit() -> None:
    model, tok = tiny_model("llama", seed=0)
    dec = Decoder(model)
    dec.prepare()
    hidden = dec.embed(torch.tensor([prompts_of(tok)[0]]))
    rope = dec.rope(hidden, torch.arange(hidden.shape[1])[None])
    got = dec.qkv(0, hidden, rope)
    x = dec.layers[0].input_layernorm(hidden)
    q, k, _ = dec.proj.qkv(0, x)
    b, t, _ = x.shape
    q = q.view(b, t, dec.num_heads, dec.head_dim).transpose(1, 2)
    k = k.view(b, t, dec.num_kv_heads, dec.head_dim).transpose(1, 2)
    cos, sin = (r.unsqueeze(1) for r in rope)
    assert torch.equal(got.q, q * cos + rotate_half(q) * sin)
    assert torch.equal(got.k, k * cos + rotate_half(k) * sin)
