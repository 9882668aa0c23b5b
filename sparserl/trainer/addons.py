"""Add-on learners: components trained beside the policy each step (DistillSparse's adapter), called by the
loop through one seam instead of branches of their own. One small class per add-on in a registry; the ones
whose `enabled(cfg)` is true are built at setup."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from sparserl.registry import Registry

if TYPE_CHECKING:  # type names only: the add-ons themselves import the trainer's modules
    from sparserl.config import TrainConfig
    from sparserl.trainer.checkpoint import Checkpoint, Part
    from sparserl.trainer.policy import Policy
    from sparserl.trainer.update import Batch


class AddOn:
    """`update(step, batch, policy_lr)` after the policy's update (returns metrics); `part()` what a
    checkpoint keeps of it (a named sub-folder), `resume(ckpt)` its inverse. `needs_dense_logprobs`: the batch
    must carry the dense policy's log-probs (`batch.logp_old`) even where the learner would not need them;
    `records_held`: the rollout must record what an evicting sampler held."""

    name: ClassVar[str] = ""
    needs_dense_logprobs: ClassVar[bool] = False
    records_held: ClassVar[bool] = False

    def __init__(self, cfg: TrainConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        self.notes: list[str] = []  # said once the run starts

    @classmethod
    def enabled(cls, cfg: TrainConfig) -> bool:
        raise NotImplementedError

    def update(self, step: int, batch: Batch, policy_lr: float) -> dict[str, float]:
        raise NotImplementedError

    def part(self) -> Part:
        raise NotImplementedError

    def resume(self, ckpt: Checkpoint) -> None:
        raise NotImplementedError


ADDONS: Registry[type[AddOn]] = Registry("add-on")
register_addon = ADDONS.register  # class decorator: built whenever the class's `enabled(cfg)` says so


def make_addons(cfg: TrainConfig, policy: Policy) -> list[AddOn]:
    """The add-ons this config switches on, in registration order."""
    return [cls(cfg, policy) for cls in ADDONS.values() if cls.enabled(cfg)]


def dense_logprobs_needed(addons: list[AddOn]) -> bool:
    return any(a.needs_dense_logprobs for a in addons)


def records_held(addons: list[AddOn], cfg: Any) -> bool:
    """Whether the rollout records held positions: an add-on asks, and the cache evicts."""
    return any(a.records_held for a in addons) and cfg.kv.evicting
