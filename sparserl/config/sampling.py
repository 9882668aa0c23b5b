"""The sampling section: which prompts a step spends its rollouts on, and how many samples each gets (the group
source: fresh prompts, DARS, VCRL or your own) and DAPO's dynamic sampling on top of any of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from sparserl.config.errors import ConfigError

DARS_SCHEDULES = ("et", "hw")


@dataclass
class SamplingConfig:
    """Which groups a step runs (sparserl/rollout/sources.py and sampling.py)."""

    method: str = field(
        default="fresh",
        metadata={
            "help": "Group source: a name registered in GROUP_SOURCES (register your own with "
            "register_group_source); `sparserl train --help` lists them with what each does after the keys. "
            "Formerly rollout.source."
        },
    )
    dynamic: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling: drop the groups whose rewards are all equal (zero advantage) and run "
            "more groups until prompts_per_step groups with a signal are in, at most sampling.max_extra_rounds "
            "more rounds; short of that, the batch is filled with dropped groups (counted)."
        },
    )
    max_extra_rounds: int = field(
        default=4,
        metadata={
            "help": "Cap on the extra rounds of one step (dynamic sampling's refills, VCRL's refills): the "
            "rollout cost of a step is at most (1 + this) x a plain step's."
        },
    )
    token_budget: int = field(
        default=0,
        metadata={
            "help": "End the run once its steps have drawn this many tokens in all (every round, trained or not: "
            "sampling/generated_tokens_total), to compare methods at an equal rollout budget; the run then "
            "ends as at trainer.steps (final evaluation, export, summary). trainer.steps still bounds it and "
            "sets the lr schedule's horizon. 0: no budget."
        },
    )
    dars_schedule: str = field(
        default="et",
        metadata={
            "help": "DARS: 'et' (equal treatment: every hard prompt brought to the peak cumulative |advantage|) "
            "or 'hw' (hardness weighted: 2(1 - a) x the peak, so the hardest get the most)."
        },
    )
    dars_n_max: int = field(
        default=32,
        metadata={
            "help": "DARS: most samples a prompt gets in one step, first round included (paper: 32 et, 64 hw)."
        },
    )
    dars_keep_degenerate: bool = field(
        default=False,
        metadata={
            "help": "DARS: keep the groups still all-wrong or all-right after the second round in the batch "
            "(zero advantage). The paper's code drops them (false)."
        },
    )
    vcrl_kappa: float = field(
        default=0.3,
        metadata={
            "help": "VCRL: a group whose normalised reward variance p = var / var_max is below this is dropped "
            "from the batch and refilled; prompts at or above it enter the memory bank."
        },
    )
    vcrl_replay_fraction: float = field(
        default=0.5,
        metadata={
            "help": "VCRL: most of a step's first-round groups replayed from the memory bank (the rest fresh)."
        },
    )
    vcrl_bank_size: int = field(
        default=1024,
        metadata={"help": "VCRL: most prompts in the memory bank (the lowest priority leaves first)."},
    )
    vcrl_max_age: int = field(
        default=50,
        metadata={"help": "VCRL: a banked prompt not seen for more than this many steps leaves the bank."},
    )
    vcrl_ema: float = field(
        default=0.9,
        metadata={"help": "VCRL: a replayed prompt's priority becomes ema x old + (1 - ema) x its new p."},
    )

    def __post_init__(self) -> None:
        if self.token_budget < 0:
            raise ConfigError(f"sampling.token_budget={self.token_budget} must be >= 0")
        if self.max_extra_rounds < 0:
            raise ConfigError(f"sampling.max_extra_rounds={self.max_extra_rounds} must be >= 0")
        if self.dars_schedule not in DARS_SCHEDULES:
            raise ConfigError(
                f"sampling.dars_schedule={self.dars_schedule!r}: choose one of {', '.join(DARS_SCHEDULES)}"
            )
        if self.dars_n_max < 1:
            raise ConfigError(f"sampling.dars_n_max={self.dars_n_max} must be >= 1")
        for key in ("vcrl_kappa", "vcrl_replay_fraction", "vcrl_ema"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"sampling.{key}={getattr(self, key)} must be in [0, 1]")
        for key in ("vcrl_bank_size", "vcrl_max_age"):
            if getattr(self, key) < 0:
                raise ConfigError(f"sampling.{key}={getattr(self, key)} must be >= 0")
