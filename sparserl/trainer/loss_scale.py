"""Dynamic loss scaling for `model.dtype=float16`: the loss is multiplied by a scale S before the backward, so that
small gradients survive float16's range, and the accumulated gradients are divided by S (with the loss
denominator, in the same division) before clipping. An update whose gradient norm is not finite overflowed: it
is skipped and S halved (train/fp16_overflow_skips); after `growth_interval` updates in a row without one, S
doubles. S is a power of two, so scaling and unscaling are exact.

torch.amp.GradScaler runs on the CPU in torch 2.13 and was the first choice; it is not used because its overflow
test is its own per-process pass over the gradients it unscales, while the learner already divides the
gradients by the loss denominator and skips an update whose global gradient norm is not finite, a decision that
every data-parallel or FSDP rank agrees on (an FSDP rank holds a shard of the gradients only: GradScaler's
found-inf would differ between ranks without ShardedGradScaler's extra all-reduce). Here the overflow test is
that same norm, so every rank keeps the same S.

S starts at 2^8, not GradScaler's 2^16: the learner's loss is a sum over the micro-batch's tokens (divided by the
loss denominator only after the backward), so a token's gradient is of the order of its advantage, not of
1 / tokens as under the mean loss 2^16 is chosen for. On the tiny test model 2^16 overflowed every update and 2^11
still overflowed some; each skipped update throws away a mini-batch of rollouts. The factors (x2 after 2000
updates without an overflow, x0.5 at one) are GradScaler's.

The scale travels with the optimizer's state (`attach`): `optimizer.state_dict()` carries it under
`LOSS_SCALE_KEY` and `load_state_dict` restores it, so a checkpoint keeps it beside the optimizer and a resume,
or a learner rank loaded from the trainer's optimizer, continues with it.
"""

from __future__ import annotations

from typing import Any

import torch

LOSS_SCALE_KEY = "fp16_loss_scale"


class DynamicLossScale:
    """The current scale S and the count of updates since it last changed (see the module docstring)."""

    def __init__(
        self,
        init_scale: float = 2.0**8,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale, self.good_steps = init_scale, 0
        self.growth, self.backoff, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def overflowed(self) -> None:
        """An update's gradient was not finite: it was skipped; lower S."""
        self.scale *= self.backoff
        self.good_steps = 0

    def stepped(self) -> None:
        """An update was taken; raise S after `growth_interval` of them in a row."""
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def attach(optimizer: torch.optim.Optimizer, scale: DynamicLossScale) -> None:
    """Carry `scale` in `optimizer`'s state dict (saved under LOSS_SCALE_KEY, restored on load; a state dict
    without it, from a run in another dtype, leaves the scale as it is)."""

    def saved(_: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, LOSS_SCALE_KEY: scale.state_dict()}

    def loading(_: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        if LOSS_SCALE_KEY in state:
            scale.load_state_dict(state[LOSS_SCALE_KEY])
        return {k: v for k, v in state.items() if k != LOSS_SCALE_KEY}

    optimizer.register_state_dict_post_hook(saved)
    optimizer.register_load_state_dict_pre_hook(loading)
