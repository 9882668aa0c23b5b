"""The LM head's log-probs of target tokens (and entropies) a chunk of positions at a time, so that the
[tokens, vocabulary] logits never exist whole (engine/scoring.py's teacher-forced passes: old, reference and the
learner's): `target_logprobs` from given logits, `head_logprobs` from hidden states through the head."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from sparserl.algo.keep_sampling import unpack_kept
from sparserl.engine.weights import head_logits


def head_logprobs(
    lm_head: nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    kept: Tensor | None = None,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """`target_logprobs(lm_head(hidden), ...)` ([..., H] and [...] -> [...]), and with `with_entropy` each
    position's entropy too, with the head run `TARGET_CHUNK` positions at a time, so that the [..., V] logits
    never exist whole, where autograd would keep them and build their gradient whole (8 rows x 64 tokens x
    SmolLM2's 49,152 ids: 100 MB each, and the entropy several copies more; 5 GB a row at 4k tokens and Qwen's
    151,936). With grad, a frozen head (LoRA) takes each position's gradient in the forward
    (`_FrozenHeadLogprobs`); a trained one checkpoints each chunk (torch.utils.checkpoint: its head runs again in
    the backward). Fused kernels that do this (Liger's fused linear cross-entropy) need a GPU.

    The same numbers as the whole head, bit for bit on CPU (a row's logits do not depend on the other rows of the
    product; each position's log-softmax and entropy reduce its own row). Gradients a rounding apart from the
    whole head's: through a checkpointed chunk the hidden states' are bit for bit without entropy and the
    weight's sums the chunks (3.6e-7 relative); a frozen head's 3.2e-7 relative (tests/test_scoring.py)."""
    flat, idx = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    bits = kept.reshape(-1, kept.shape[-1]) if kept is not None else None
    grad = torch.is_grad_enabled()
    if grad and flat.requires_grad and not any(w.requires_grad for w in lm_head.parameters()):
        out = _FrozenHeadLogprobs.apply(flat, lm_head, idx, temperature, bits, with_entropy)
        return out.view(targets.shape) if not with_entropy else tuple(o.view(targets.shape) for o in out)
    parts = []
    for rows in _chunks(flat.shape[0]):
        chunk = partial(_chunk_logprobs, lm_head, idx[rows], temperature,
                        None if bits is None else bits[rows], with_entropy)  # fmt: skip
        if grad:
            parts.append(checkpoint(chunk, flat[rows], use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(chunk(flat[rows]))
    if not with_entropy:
        return torch.cat(parts).view(targets.shape)
    return tuple(torch.cat([p[i] for p in parts]).view(targets.shape) for i in (0, 1))


class _FrozenHeadLogprobs(torch.autograd.Function):
    """`head_logprobs` for a head that takes no gradient (LoRA's frozen head), without running it twice: a
    position's log-prob (and entropy) depends on its own hidden state alone, so its gradient to that state is one
    H-vector, taken in the forward chunk by chunk (the head's own backward applied to d logp / d logits:
    onehot - p, over T) and scaled by the incoming gradient in the backward. Kept: two [N, H] tensors at most,
    where checkpointing keeps the hidden states and runs the head again (one more head matmul a chunk)."""

    @staticmethod
    def forward(ctx, flat, lm_head, targets, temperature, kept, with_entropy):  # type: ignore[override]
        outs, jacobians = [], []
        for rows in _chunks(flat.shape[0]):
            with torch.enable_grad():
                h = flat[rows].detach().requires_grad_(True)
                logits = head_logits(lm_head, h).float()
            # in place where it can be: two [chunk, V] tensors alive (three for entropy)
            with torch.no_grad():
                scaled = _kept_only(
                    _tempered(logits.detach(), temperature), None if kept is None else kept[rows]
                )
                logp_all = scaled.log_softmax(dim=-1)
                logp = logp_all.gather(-1, targets[rows, None]).squeeze(-1)
                wants = []
                if with_entropy:
                    dropped = scaled == float("-inf")
                    safe = logp_all.masked_fill_(dropped, 0.0)
                    p = safe.exp().masked_fill_(dropped, 0.0)
                    entropy = -(p * safe).sum(-1)
                    wants.append(safe.add_(entropy[:, None]).mul_(p).div_(-temperature))
                else:
                    p = logp_all.exp_()
                del scaled
                ones = torch.ones_like(p[:, :1])
                wants.insert(
                    0, _tempered(p.neg_().scatter_add_(-1, targets[rows, None], ones), temperature, True)
                )
            jacobians.append(torch.stack([
                torch.autograd.grad(logits, h, want, retain_graph=i + 1 < len(wants))[0]
                for i, want in enumerate(wants)
            ]))  # fmt: skip
            outs.append((logp, entropy) if with_entropy else (logp,))
        ctx.save_for_backward(torch.cat(jacobians, dim=1))
        ctx.with_entropy = with_entropy
        logp = torch.cat([o[0] for o in outs])
        return (logp, torch.cat([o[1] for o in outs])) if with_entropy else logp

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        (jac,) = ctx.saved_tensors  # [1 or 2, N, H]
        g = grads[0][:, None] * jac[0]
        if ctx.with_entropy:
            g = g + grads[1][:, None] * jac[1]
        return g, None, None, None, None, None


def _chunk_logprobs(lm_head: nn.Module, targets: Tensor, temperature: float, kept: Tensor | None,
                    with_entropy: bool, hidden: Tensor) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """One chunk of `head_logprobs`: at most `TARGET_CHUNK` positions, so `target_logprobs` takes it whole."""
    logits = head_logits(lm_head, hidden).float()
    if not with_entropy:
        return target_logprobs(logits, targets, temperature, kept)
    scaled = _kept_only(_tempered(logits, temperature), kept)
    logp_all = scaled.log_softmax(dim=-1)
    entropy = -(logp_all.exp() * logp_all.masked_fill(scaled == float("-inf"), 0.0)).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), entropy


def _tempered(logits: Tensor, temperature: float, in_place: bool = False) -> Tensor:
    """`logits / temperature`; at temperature 1 `logits` itself (the division would be a pass over [N, V] for the
    same numbers: x / 1 is x exactly; 2% of a full fine-tuning update's CPU time, the trained head's chunks)."""
    if temperature == 1.0:
        return logits
    return logits.div_(temperature) if in_place else logits / temperature


def _kept_only(logits: Tensor, kept: Tensor | None) -> Tensor:
    """`logits` [..., V] with the ids outside `kept` (bits [..., V / 8]; None: all kept) at -inf."""
    if kept is None:
        return logits
    return logits.masked_fill(~unpack_kept(kept, logits.shape[-1]).to(logits.device), float("-inf"))


TARGET_CHUNK = 256
"""Positions per slice in `target_logprobs`: 256 x 49152 float32 logits is 48 MiB a slice (two alive at once)."""


def _chunks(n: int) -> list[slice]:
    """Slices of `TARGET_CHUNK` positions (the last shorter) covering `n`."""
    return [slice(s, s + TARGET_CHUNK) for s in range(0, n, TARGET_CHUNK)]


def target_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, kept: Tensor | None = None
) -> Tensor:
    """`(logits / temperature).log_softmax(-1)` gathered at `targets` ([..., V] and [...] -> [...]), computed
    `TARGET_CHUNK` positions at a time so that the whole [..., V] division and log-softmax never exist at once:
    without grad, the dense scoring pass holds the logits alone instead of three copies of them (its peak in the
    default run: 0.67 GB lower, docs/results/rl_step.json `memory`). With `kept` (bits [..., V / 8]), over each
    position's kept ids only.

    Bit for bit the unchunked result: the division is elementwise, the log-softmax reduces each position's row on
    its own (max, sum of exps, log; the same vectorised order whatever the number of rows), the gather copies."""
    v = logits.shape[-1]
    flat, idx = logits.reshape(-1, v), targets.reshape(-1, 1)
    bits = kept.reshape(-1, kept.shape[-1]) if kept is not None else None
    parts = [
        _kept_only(_tempered(flat[rows], temperature), bits[rows] if bits is not None else None)
        .log_softmax(dim=-1)
        .gather(-1, idx[rows])
        .squeeze(-1)
        for rows in _chunks(flat.shape[0])
    ]
    return torch.cat(parts).view(targets.shape)
