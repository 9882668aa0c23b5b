"""The rollout section: what is sampled per step, and how the rollout layer schedules it (a KV memory cap for
continuous batching, asynchronous rewards, APRIL partial rollouts)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sparserl.config.errors import ConfigError
from sparserl.sizes import size_in_bytes

PARTIAL_MODES = ("train_all", "mask_old")
BATCHING = ("continuous", "static")


def parse_bytes(value: str | int | float, key: str) -> int:
    """Bytes from an int or a string with a unit (512MiB, 4GiB, 1.5GB, 1000000); `key` names it in errors."""
    try:
        size = size_in_bytes(value)
    except ValueError:
        raise ConfigError(
            f"{key}={value!r} is not a size: write bytes or a number with a unit (KiB, MiB, GiB, KB, MB, GB)"
        ) from None
    if size <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive size")
    return size


@dataclass
class PartialConfig:
    """APRIL: over-provision prompts, stop when enough groups finished, continue the rest at the next step."""

    enable: bool = field(
        default=False,
        metadata={
            "help": "Active partial rollouts: start over_provision x prompts_per_step groups, stop decoding once "
            "prompts_per_step groups have finished and been scored, and keep the unfinished samples (tokens, "
            "sampler log-probs, the policy version of each token) to continue at the next step under the new "
            "weights (prompt + partial completion re-prefilled). Groups left over are served before new prompts."
        },
    )
    over_provision: float = field(
        default=2.0,
        metadata={"help": "Groups started per step, as a multiple of rollout.prompts_per_step (>= 1)."},
    )
    mode: str = field(
        default="train_all",
        metadata={
            "help": "What the loss does with tokens drawn by an older policy: 'train_all' trains them (with "
            "algo.correction_mode decoupled or bypass their recorded sampler log-probs let the corrections weigh "
            "staleness and sparsity together; with correction_mode none they are trained as if the current "
            "policy had drawn them, uncorrected, and a warning says so), 'mask_old' leaves them out of the "
            "loss (they still condition the newer tokens)."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "A leftover group whose oldest token is more than this many policy versions old is dropped "
            "(counted in rollout/partial_dropped_groups) instead of continued."
        },
    )

    def __post_init__(self) -> None:
        if not 1 <= self.over_provision < math.inf:
            raise ConfigError(
                f"rollout.partial.over_provision={self.over_provision} must be a finite number >= 1 (it multiplies prompts_per_step)"
            )
        if self.mode not in PARTIAL_MODES:
            raise ConfigError(f"rollout.partial.mode={self.mode!r}: choose one of {', '.join(PARTIAL_MODES)}")
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.partial.max_staleness={self.max_staleness} must be >= 0")


@dataclass
class OverlapConfig:
    """Overlapped steps (one-step off-policy RL): the next step's rollout runs while this step updates."""

    enable: bool = field(
        default=False,
        metadata={
            "help": "Sample step t+1 while step t updates, with the weights the sampler last received (at most "
            "max_staleness versions behind the learner). The recorded sampler log-probs are the older policy's, "
            "pi_old is recomputed at the learner's version, so the corrections weigh staleness and sparsity "
            "together; rollout/staleness_* and rollout/off_policy_token_frac say how stale each batch was. The "
            "field's names for it: verl's one-step-off-policy recipe and its fully async trainer's "
            "`async_training.staleness_threshold`, AReaL's `max_head_offpolicyness`, slime's `train_async.py`. "
            "The local backend samples on a replica of the policy (LoRA: the adapter only, the frozen base is "
            "shared) on a thread of its own; a Ray backend's workers sample while the learner updates."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "Policy versions the sampler may lag the learner: 1 overlaps one step; 0 samples every step "
            "with the learner's weights (the same run as enable=false). A batch older than this is never trained."
        },
    )

    def __post_init__(self) -> None:
        if self.max_staleness not in (0, 1):
            raise ConfigError(
                f"rollout.overlap.max_staleness={self.max_staleness}: 0 or 1 (one step ahead) are implemented; "
                "a deeper pipeline is not"
            )

    @property
    def active(self) -> bool:
        """True when a rollout runs ahead of the update (enable with max_staleness 1)."""
        return self.enable and self.max_staleness > 0


SPEC_PREFIX_LOGPS = ("verifier", "cached")
SPEC_ACCEPTANCES = ("coupled", "ratio")
SPEC_VERIFICATIONS = ("batched", "exact")


@dataclass
class SpecConfig:
    """SPEC-RL: a returning prompt's previous responses are drafts, verified under the current policy; each
    keeps its prefix up to the first rejected token and samples on from there."""

    enable: bool = field(
        default=False,
        metadata={
            "help": "Reuse each prompt's previous responses when it returns (a later epoch): verify each "
            "teacher-forced under the current policy, keep the prefix up to the first token rejected by "
            "u <= min(1, e^lenience p_now / p_then) (fresh uniforms each step), sample on from the cut. A "
            "response accepted whole (its end included) is not generated again."
        },
    )
    acceptance: str = field(
        default="coupled",
        metadata={
            "help": "'coupled': a draft is kept up to the first token the current policy draws otherwise at the "
            "draft's own uniform numbers (its stream), and the sample goes on on that stream: every delivered "
            "sample is the one the current policy draws on it (no log-probs cached, no lenience). 'ratio': "
            "SPEC-RL's test u <= min(1, e^lenience p_now / p_then), the rejected token drawn afresh from the "
            "current policy: delivered samples lean toward the policy that drew the drafts (docs/rollout.md)."
        },
    )
    verify: str = field(
        default="batched",
        metadata={
            "help": "'batched': the drafts are verified teacher-forced together (on the sampler: a prompt's drafts "
            "in one pass after it; elsewhere in micro-batches; a token near a draw's boundary may flip with batch "
            "mates' rounding: tests/test_spec_coupled.py compares the two); 'exact': one draft at a time."
        },
    )
    lenience: float = field(
        default=0.0,
        metadata={
            "help": "acceptance=ratio: lambda >= 0, the test multiplies p_now / p_then by e^lambda (SPEC-RL's "
            "bias)."
        },
    )
    prefix_logp: str = field(
        default="verifier",
        metadata={
            "help": "acceptance=ratio: sampler log-prob recorded for accepted tokens: 'verifier' (the current policy's, so the "
            "corrections see ratio 1, as SPEC-RL) or 'cached' (the policy's that drew them: the corrections "
            "treat them as off-policy tokens)."
        },
    )
    max_cached_tokens: int = field(
        default=2_000_000,
        metadata={
            "help": "Bound on the cache of previous responses, in tokens (measured: ~72 bytes a token with its "
            "log-prob in memory, ~27 in the checkpoint's JSON, of which the cache is a part): the prompts cached "
            "longest ago leave first."
        },
    )

    def __post_init__(self) -> None:
        if not 0 <= self.lenience < math.inf:
            raise ConfigError(f"rollout.spec.lenience={self.lenience} must be a finite number >= 0")
        for key, allowed in (("acceptance", SPEC_ACCEPTANCES), ("verify", SPEC_VERIFICATIONS)):
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"rollout.spec.{key}={getattr(self, key)!r}: choose one of {', '.join(allowed)}"
                )
        if self.enable and self.acceptance == "coupled" and self.lenience:
            raise ConfigError(
                f"rollout.spec.lenience={self.lenience} applies to acceptance=ratio only (coupled drafts are "
                "kept exactly where the current policy draws them)"
            )
        if self.prefix_logp not in SPEC_PREFIX_LOGPS:
            raise ConfigError(
                f"rollout.spec.prefix_logp={self.prefix_logp!r}: choose one of {', '.join(SPEC_PREFIX_LOGPS)}"
            )
        if self.max_cached_tokens < 0:
            raise ConfigError(f"rollout.spec.max_cached_tokens={self.max_cached_tokens} must be >= 0")


@dataclass
class TreeConfig:
    """Tree rollouts (TreeRL's EPTree, the language-model analogue of BranchGRPO): the group's rollout.n samples
    are roots; every finished path fewer than `rounds` forks deep forks at its most uncertain tokens."""

    enable: bool = field(
        default=False,
        metadata={
            "help": "Grow each group as a tree: rollout.n roots; every path, once finished and while fewer than "
            "`rounds` forks deep, forks at its `forks` most uncertain tokens (highest -log p of the sampled token), "
            "`children` children each, which keep the path up to there (the parent's sampler log-probs) and "
            "draw on from that token on their own streams: in the parent's run on the local backend, in the "
            "step's next round on Ray. All paths are leaves of one group; train them with GRPO over the leaves "
            "or algo.adv_transforms=[tree] (TreeRL's process reward)."
        },
    )
    rounds: int = field(
        default=1,
        metadata={
            "help": "L: fork depth, the forks on a root-to-leaf path (on a backend that keeps rounds, as Ray does, "
            "each one of sampling.max_extra_rounds; the local backend forks in the running run)."
        },
    )
    forks: int = field(default=2, metadata={"help": "T: fork points per path."})
    children: int = field(default=2, metadata={"help": "N: children per fork point."})

    def __post_init__(self) -> None:
        for key in ("rounds", "forks", "children"):
            if getattr(self, key) < 1:
                raise ConfigError(f"rollout.tree.{key}={getattr(self, key)} must be >= 1")


@dataclass
class RolloutConfig:
    """How many completions are sampled per step, and how."""

    prompts_per_step: int = field(default=4, metadata={"help": "Prompts drawn from the task per step."})
    n: int = field(default=8, metadata={"help": "Completions sampled per prompt: the GRPO group size G."})
    max_new_tokens: int = field(
        default=64, metadata={"help": "Completion length cap; longer ones finish with reason 'length'."}
    )
    temperature: float = field(
        default=1.0,
        metadata={"help": "Sampling temperature (> 0); the learner and pi_old score at it too."},
    )
    sampler_temperature: float | None = field(
        default=None,
        metadata={
            "help": "The sampler's own temperature (> 0), while the learner and pi_old keep rollout.temperature; "
            "the recorded log-probs are the sampler's. None: rollout.temperature (bit for bit the same sampler). "
            "A sampler that differs from pi_old by construction: the positive control of `sparserl bias` "
            "(docs/bias.md), and a way to check that the corrections see a mismatch at all."
        },
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "help": "Nucleus sampling: keep the smallest set with mass >= top_p. Training refuses < 1: the "
            "sampler's log-probs would be of the truncated distribution, pi_old's of the full softmax."
        },
    )
    top_k: int = field(
        default=0,
        metadata={
            "help": "Keep the k most likely tokens; 0 disables. Training refuses > 0, as rollout.top_p < 1."
        },
    )
    stop: list[str] = field(
        default_factory=list,
        metadata={"help": "Extra stop strings (the tokenizer's EOS always stops a completion)."},
    )
    kv_memory_cap: str | None = field(
        default=None,
        metadata={
            "help": "KV cache memory the rollout may hold, in bytes or with a unit (512MiB, 4GiB). Sequences are "
            "admitted as memory frees (rollout.batching), so the saved memory of a sparse cache becomes a "
            "larger concurrent batch. None: all of a step's sequences decode at once."
        },
    )
    batching: str = field(
        default="continuous",
        metadata={
            "help": "Under kv_memory_cap: 'continuous' admits a waiting sequence whenever one fits and preempts "
            "the newest when the cache must grow past the cap; 'static' fills the cap with whole-length "
            "sequences and waits for all of them to finish before admitting more."
        },
    )
    async_rewards: bool = field(
        default=True,
        metadata={
            "help": "Score each group as soon as its samples finish, on a worker thread, while decoding goes on."
        },
    )
    partial: PartialConfig = field(
        default_factory=PartialConfig, metadata={"help": "APRIL active partial rollouts."}
    )
    spec: SpecConfig = field(
        default_factory=SpecConfig,
        metadata={"help": "SPEC-RL: previous responses reused as verified drafts."},
    )
    tree: TreeConfig = field(default_factory=TreeConfig, metadata={"help": "Tree rollouts (TreeRL)."})
    overlap: OverlapConfig = field(
        default_factory=OverlapConfig,
        metadata={
            "help": "Overlapped steps: the next rollout runs while this step updates (one-step off-policy)."
        },
    )
    backend: str = field(
        default="local",
        metadata={
            "help": "Rollout backend: what decodes the samples and returns plain segments "
            "(sparserl/rollout/backend.py BACKENDS; register your own with register_backend). 'local': this "
            "process's engine under the scheduler."
        },
    )

    def __post_init__(self) -> None:
        for key in ("prompts_per_step", "n", "max_new_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"rollout.{key}={getattr(self, key)} must be >= 1")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"rollout.temperature={self.temperature} must be a finite number > 0")
        if self.sampler_temperature is not None and not 0 < self.sampler_temperature < math.inf:
            raise ConfigError(
                f"rollout.sampler_temperature={self.sampler_temperature} must be a finite number > 0 (or null)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"rollout.top_k={self.top_k} must be >= 0")
        if any(not s for s in self.stop):
            raise ConfigError(f"rollout.stop={self.stop!r}: stop strings must be non-empty")
        if self.kv_memory_cap is not None:
            parse_bytes(self.kv_memory_cap, "rollout.kv_memory_cap")
        if self.batching not in BATCHING:
            raise ConfigError(f"rollout.batching={self.batching!r}: choose one of {', '.join(BATCHING)}")

    @property
    def kv_memory_cap_bytes(self) -> int | None:
        """rollout.kv_memory_cap in bytes (None: no cap)."""
        return (
            None if self.kv_memory_cap is None else parse_bytes(self.kv_memory_cap, "rollout.kv_memory_cap")
        )

    @property
    def sampling_temperature(self) -> float:
        """The temperature the sampler draws at: rollout.sampler_temperature, else rollout.temperature."""
        return self.temperature if self.sampler_temperature is None else self.sampler_temperature
