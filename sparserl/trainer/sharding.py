"""FSDP for the learner ranks (`distributed.fsdp`): each rank holds 1/N of the policy's trainable parameters,
their gradients and AdamW's state (PyTorch FSDP2, `fully_shard`) instead of a whole copy, and gathers a decoder
layer's weights only around that layer's forward and backward.

- Units: every decoder layer, and a root (`ShardedScoring`) that owns the rest (embeddings, final norm, head:
  tied weights stay in one unit) and whose forward is the learner's scoring, so FSDP gathers the root's weights
  around the whole of it. The scoring then runs each row's whole sequence (`scoring.layers_sharded`).
- Gradients are summed over the ranks, not averaged, as `TorchCollective.sum_gradients` sums them: the loss
  denominators are explicit sums agreed before the step. Divide factor 1, with sum-only collectives (gloo has no
  pre-scaled sum).
- Every rank runs every forward and backward (`learner_group.ShardedCollective.lockstep`), a micro-batch that is not finite
  included (a zero stand-in loss), since the gathers and reductions are collectives inside them.
- What goes in and out is the one-learner format (whole tensors; the optimizer's state keyed by parameter
  index), so checkpoints resume with or without FSDP and with any number of ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sparserl.engine import completion_logprobs
from sparserl.errors import UserError


class ShardedScoring(nn.Module):
    """The FSDP root: the policy as a submodule, and `completion_logprobs` over it as the forward."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, prompts: list, completions: list, **kwargs: Any) -> tuple[Tensor, ...]:
        return completion_logprobs(self.policy, prompts, completions, **kwargs)


def shard(policy: nn.Module) -> ShardedScoring:
    """Shard `policy` in place (its parameters become DTensors) over the default process group; the root to
    score through."""
    from torch.distributed.fsdp import fully_shard

    layers = [m for m in policy.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise UserError(
            f"distributed.fsdp: {type(policy).__name__} has no decoder layers (modules named *DecoderLayer, as "
            "in transformers' causal LMs) to shard; set distributed.fsdp=false"
        )
    root = ShardedScoring(policy)
    for layer in layers:
        fully_shard(layer)
    fully_shard(root)
    for unit in (*layers, root):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return root


def full_weights(policy: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """The named parameters as whole tensors on the CPU (a collective: every rank calls it)."""
    named = dict(policy.named_parameters())
    return {n: named[n].full_tensor().detach().cpu() for n in names}


def _shard_like(full: Tensor, param: Tensor) -> Tensor:
    """This rank's shard of a whole tensor shaped as `param` (a DTensor), cut from its own copy (no message)."""
    from torch.distributed.tensor import distribute_tensor

    full = full.to(param.device, param.dtype)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def load_weights(policy: nn.Module, weights: dict[str, Tensor]) -> None:
    """Whole tensors (some of the parameters) into the sharded policy, each rank keeping its shard."""
    named = dict(policy.named_parameters())
    with torch.no_grad():
        for name, full in weights.items():
            named[name].copy_(_shard_like(full, named[name]))


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with whole tensors, as one learner's (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    state = optimizer.state_dict()
    whole = {
        i: {k: v.full_tensor().cpu() if isinstance(v, DTensor) else v for k, v in entry.items()}
        for i, entry in state["state"].items()
    }
    return {**state, "state": whole}  # other entries (float16's loss scale) as they are


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """One learner's optimizer state dict into the sharded optimizer: every tensor shaped as its parameter is
    cut to this rank's shard (AdamW's moments), the rest (its step count) kept whole. Loaded as is, not through
    torch.distributed.checkpoint, whose loading first takes a zero step (its step count would be one ahead)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {
        i: {
            k: _shard_like(v, params[i]) if torch.is_tensor(v) and v.shape == params[i].shape else v
            for k, v in entry.items()
        }
        for i, entry in state["state"].items()
    }
    optimizer.load_state_dict({**state, "state": sharded})
