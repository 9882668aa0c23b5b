"""The acceptance rate alpha_t of sampled tokens: the sampler's recorded distributions against the dense policy's
on the same prefixes (sparserl.algo.acceptance), for training-time logging and for calibrating KV budgets.
In the engine (it drives a `RolloutEngine` and the dense scorer) so that the trainer and eval both build on it.

Both sides are the *processed* distributions, the ones tokens are drawn from (temperature, then top-k, then
top-p, each side cut by its own top-k / nucleus): alpha is then the chance that the two actors' draws agree under
an optimal coupling, which is what Sparrow compares. Without top-k / top-p it is the tempered distributions'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from sparserl.algo.acceptance import AcceptanceBin, acceptance_by_bin, acceptance_exact, acceptance_topk
from sparserl.engine.decoder import causal_lm
from sparserl.engine.kv_config import KVConfig
from sparserl.engine.rollout import RolloutEngine, Sample
from sparserl.engine.scoring import layers_sharded, micro_batches, score_distributions


@dataclass
class TokenAcceptance:
    """Per generated token [N]: its absolute position (prompt length + index in the completion, i.e. the length
    of the prefix it was drawn after), the top-k lower bound of alpha and the exact alpha (None when the sampler
    did not record full distributions), and the index of the sample it belongs to."""

    positions: Tensor
    topk: Tensor
    exact: Tensor | None
    sequences: Tensor

    def binned(self, bin_width: int, tau: float, resamples: int = 0) -> dict[str, list[AcceptanceBin]]:
        """Each estimate's statistics per bin of absolute position (`algo.acceptance_by_bin`), with each bin's
        number of sequences, and with `resamples` > 0 the P5's sequence-level bootstrap interval."""
        estimates = {"topk": self.topk, "exact": self.exact}
        return {
            name: acceptance_by_bin(
                alpha, self.positions, bin_width, tau, sequences=self.sequences, resamples=resamples
            )  # fmt: skip
            for name, alpha in estimates.items()
            if alpha is not None
        }

    @staticmethod
    def concatenated(parts: Sequence[TokenAcceptance]) -> TokenAcceptance:
        """The tokens of `parts` together, each part's samples numbered after the previous parts'."""
        offsets = [0]
        for p in parts[:-1]:
            offsets.append(offsets[-1] + (int(p.sequences.max()) + 1 if p.sequences.numel() else 0))
        exact = all(p.exact is not None for p in parts)
        return TokenAcceptance(
            torch.cat([p.positions for p in parts]),
            torch.cat([p.topk for p in parts]),
            torch.cat([p.exact for p in parts]) if exact else None,
            torch.cat([p.sequences + o for p, o in zip(parts, offsets, strict=True)]),
        )


def rollout_acceptance(
    model: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    samples: Sequence[Sample],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    token_budget: int = 8192,
) -> TokenAcceptance:
    """alpha of every token of `samples` (generated with `top_logprobs`, and `full_logprobs` for the exact value;
    `prompt_ids[i]` is sample i's prompt) against the dense policy `model` scored on the same prefixes with the
    same sampling settings. The dense side is computed and dropped `token_budget` tokens at a time, so its
    full distributions never all sit in memory at once."""
    if len(prompt_ids) != len(samples):
        raise ValueError(f"rollout_acceptance: {len(prompt_ids)} prompts but {len(samples)} samples")
    missing = [i for i, s in enumerate(samples) if s.distributions is None]
    if missing:
        raise ValueError(
            f"rollout_acceptance: sample {missing[0]} has no recorded distributions; "
            "generate with top_logprobs=k (and full_logprobs=True for the exact alpha)"
        )
    k = samples[0].distributions.top_ids.shape[-1]
    exact = all(s.distributions.full_logprobs is not None for s in samples)
    completions = [s.completion_ids for s in samples]
    positions, topk, full, sequences = [], [], [], []
    shared = not layers_sharded(causal_lm(model))  # the scorer runs without grad in eval mode: it shares
    for chunk in micro_batches(prompt_ids, completions, token_budget, shared):
        dense = score_distributions(
            model, [prompt_ids[i] for i in chunk], [completions[i] for i in chunk],
            temperature, top_p, top_k, top_logprobs=k, full_logprobs=exact, token_budget=token_budget,
        )  # fmt: skip
        for i, d in zip(chunk, dense, strict=True):
            sparse = samples[i].distributions
            positions.append(len(prompt_ids[i]) + torch.arange(len(completions[i])))
            sequences.append(torch.full((len(completions[i]),), i))
            topk.append(acceptance_topk(sparse.top_ids, sparse.top_logprobs, d.top_ids, d.top_logprobs))
            if exact:
                full.append(acceptance_exact(sparse.full_logprobs, d.full_logprobs))
    return TokenAcceptance(
        torch.cat(positions), torch.cat(topk), torch.cat(full) if exact else None, torch.cat(sequences)
    )


def measure_acceptance(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    kv: KVConfig,
    n: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    top_logprobs: int = 20,
    exact: bool = True,
    samples_per_call: int = 0,
    ignore_eos: bool = False,
) -> TokenAcceptance:
    """Sample `n` completions per prompt with the KV policy `kv`, and return alpha of every generated token
    against the dense policy (the same `model`) on the same prefix: the calibration measurement.

    Memory: with `exact`, the sampler keeps 4 bytes x vocabulary per generated token until its alpha is taken
    (196 KB per token at SmolLM2's 49,152 ids); `samples_per_call` (0: all n at once) bounds how many samples are
    generated, and held, at a time. Call j of a prompt uses seed `seed + j` (call 0: `seed`).
    """
    if n < 1 or samples_per_call < 0 or top_logprobs < 1:
        raise ValueError(
            f"measure_acceptance: need n >= 1, samples_per_call >= 0 and top_logprobs >= 1; got n={n}, "
            f"samples_per_call={samples_per_call}, top_logprobs={top_logprobs}"
        )
    engine = RolloutEngine(model, tokenizer, kv)
    if ignore_eos:
        engine.eos_ids = set()
    per_call = samples_per_call or n
    parts = []
    for prompt in prompt_ids:
        for call, start in enumerate(range(0, n, per_call)):
            rollouts = engine.generate(
                [prompt], n=min(per_call, n - start), max_new_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, top_k=top_k, seed=seed + call, top_logprobs=top_logprobs, full_logprobs=exact,
            )  # fmt: skip
            samples = list(rollouts)
            parts.append(
                rollout_acceptance(model, [prompt] * len(samples), samples, temperature, top_p, top_k)
            )
    return TokenAcceptance.concatenated(parts)
