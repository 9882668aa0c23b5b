"""Every knob of the algorithm half: advantages, Sparse-RL corrections and the policy loss."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from sparserl.algo.advantages import ADV_ESTIMATORS, ADV_TRANSFORMS
from sparserl.algo.config_checks import check_ranges
from sparserl.algo.losses import POLICY_LOSS_ALIASES, POLICY_LOSSES, REFUSED_POLICY_LOSSES
from sparserl.algo.rs_aliases import ALIASES as RS_ALIASES
from sparserl.algo.rs_aliases import NO_EQUIVALENT as RS_NO_EQUIVALENT
from sparserl.algo.rs_aliases import rollout_rs_overrides, tighter

CORRECTION_MODES = ("none", "decoupled", "bypass")
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3_is")
SAMPLER_KL_ESTIMATORS = ("hinge", "kl")
# Other projects' names of keys here (TRL's -> verl's), accepted by algo_config and the config files
KEY_ALIASES = {"sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"}
# Knobs that only act when correction_mode is 'decoupled' or 'bypass'.
CORRECTION_KNOBS = (
    "veto_threshold",
    "token_rs_low",
    "token_rs_high",
    "tis_cap",
    "tis_batch_norm",
    "icepop_low",
    "icepop_high",
    "seq_mis_low",
    "seq_mis_high",
    "geo_rs_low",
    "geo_rs_high",
    "k3_rs_threshold",
    "prob_diff_threshold",
    "seq_tis_cap",
    "prefix_rs_low",
    "prefix_rs_high",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
)


@dataclass
class AlgoConfig:
    """Advantages, corrections and loss. Defaults are plain dense GRPO (the reference's dense baseline).

    A bound or threshold set to None switches its rule off. Ratios are pi_old / pi_sparse (xi in
    sparse-rl.md, r in field.md); `lo <= ratio <= hi` is kept (bounds inclusive).
    """

    # ---- rollouts -------------------------------------------------------------------------------
    sparse_rollout: bool = field(
        default=False,
        metadata={
            "help": "Whether the preset samples rollouts on the compressed KV cache (engine's kv.method)."
        },
    )

    # ---- advantages -----------------------------------------------------------------------------
    adv_estimator: str = field(
        default="grpo",
        metadata={
            "help": f"Advantage estimator (ADV_ESTIMATORS; register your own with register_adv_estimator), one "
            f"of {ADV_ESTIMATORS.described()}. REINFORCE++: reinforce + adv_transforms=[batch_whiten]; "
            "REINFORCE++-baseline: drgrpo + [batch_whiten] (presets reinforce++, reinforce++-baseline)."
        },
    )
    adv_transforms: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Advantage transforms applied in order after the estimator (algo/advantages.py "
            "ADV_TRANSFORMS; register your own with register_adv_transform): e.g. [batch_whiten] "
            "(REINFORCE++-baseline's batch normalisation). Empty by default."
        },
    )
    adv_eps: float = field(default=1e-6, metadata={"help": "GRPO: added to the group std before dividing."})
    adv_std_unbiased: bool = field(
        default=True, metadata={"help": "GRPO: use the unbiased (n-1) group std, as the reference does."}
    )

    # ---- corrections ----------------------------------------------------------------------------
    correction_mode: str = field(
        default="none",
        metadata={
            "help": f"One of {', '.join(CORRECTION_MODES)}. 'none': no reweighting or rejection (metrics are "
            "still logged). 'decoupled': three policies, IS/rejection on pi_old/pi_sparse with a recomputed "
            "dense pi_old, PPO clip on pi_theta/pi_old. 'bypass': no recompute, pi_old := pi_sparse as the "
            "PPO anchor; the corrections then act on the ratio given as logp_old (e.g. the learner's "
            "detached log-probs)."
        },
    )
    log_ratio_clamp: float = field(
        default=20.0,
        metadata={"help": "Log-ratios (xi, PPO ratio, sequence sums) are clamped to [-c, c] before exp."},
    )
    veto_threshold: float | None = field(
        default=None,
        metadata={"help": "Veto: reject a sequence if any response token has xi < this (Sparse-RL: 1e-4)."},
    )
    outlier_token_is_threshold_low: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided outlier veto (SkyRL's name): reject a sequence if any response token has xi below "
            "this (SkyRL suggests 1e-4); xi's log clamped to +-log_ratio_clamp as SkyRL's. veto_threshold is the "
            "one-sided rule on the unclamped xi."
        },
    )
    outlier_token_is_threshold_high: float | None = field(
        default=None,
        metadata={
            "help": "Two-sided outlier veto: reject a sequence if any response token has xi above this (SkyRL "
            "suggests 100)."
        },
    )
    token_rs_low: float | None = field(
        default=None, metadata={"help": "Token rejection: mask a token with xi below this (Sparse-RL: 0.5)."}
    )
    token_rs_high: float | None = field(
        default=None, metadata={"help": "Token rejection: mask a token with xi above this (Sparse-RL: 1.5)."}
    )
    tis_cap: float | None = field(
        default=None,
        metadata={
            "help": "Token TIS: weight w_t = min(xi_t, cap); None: no token IS weight (Sparse-RL: 1.5)."
        },
    )
    tis_batch_norm: bool = field(
        default=False,
        metadata={"help": "Divide the token weights by their mean over the originally valid tokens."},
    )
    batch_norm_min: float = field(
        default=1e-8, metadata={"help": "Batch normalisation is skipped when the weight mean is <= this."}
    )
    icepop_low: float | None = field(
        default=None,
        metadata={"help": "IcePop: w_t = xi_t * 1[low <= xi_t <= high]; lower bound (e.g. 0.5)."},
    )
    icepop_high: float | None = field(
        default=None, metadata={"help": "IcePop: upper bound of the kept xi (e.g. 5.0)."}
    )
    seq_mis_low: float | None = field(
        default=None,
        metadata={"help": "Seq-MIS: sequence weight prod_t xi_t, sequence rejected below this (e.g. 0.5)."},
    )
    seq_mis_high: float | None = field(
        default=None,
        metadata={"help": "Seq-MIS: sequence rejected when prod_t xi_t is above this (e.g. 2.0)."},
    )
    geo_rs_low: float | None = field(
        default=None,
        metadata={"help": "Geo-RS: keep a sequence iff exp(mean_t log xi_t) >= low (and <= high)."},
    )
    geo_rs_high: float | None = field(
        default=None, metadata={"help": "Geo-RS: upper bound of the kept geometric-mean ratio."}
    )
    k3_rs_threshold: float | None = field(
        default=None,
        metadata={
            "help": "K3-RS: reject a sequence if mean_t k3_t (xi - 1 - log xi) exceeds this (e.g. 0.01)."
        },
    )
    seq_tis_cap: float | None = field(
        default=None,
        metadata={
            "help": "Sequence TIS: every token of a sequence weighted by min(prod_t xi_t, cap), no rejection "
            "(verl's rollout_is=sequence; e.g. 2.0)."
        },
    )
    rollout_rs: list[str] = field(
        default_factory=list,
        metadata={
            "help": "verl rejection names as aliases, entries 'name:threshold' ANDed with the bounds above "
            f"(e.g. [token_k3:2.0]): {', '.join(RS_ALIASES)}. No equivalent here, refused: "
            f"{', '.join(RS_NO_EQUIVALENT)} (docs/algorithm.md)."
        },
    )
    prob_diff_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Sign-aware probability-difference mask (prime-rl): mask a token if A > 0 and "
            "p_old - p_sparse > this, or A < 0 and p_old - p_sparse < -this (e.g. 0.2). Needs advantages."
        },
    )
    prefix_rs_low: float | None = field(
        default=None,
        metadata={
            "help": "Prefix rejection (SMD's faithful tokens, docs/algorithm.md): mask every token of a sequence "
            "from the first one whose xi is below this onwards, so only the tokens drawn before the sampler "
            "first diverged from pi_old train (preset smd: 0.5)."
        },
    )
    prefix_rs_high: float | None = field(
        default=None,
        metadata={
            "help": "Prefix rejection: the same from the first token whose xi is above this (smd: 2.0)."
        },
    )

    # ---- loss -----------------------------------------------------------------------------------
    policy_loss: str = field(
        default="ppo_clip",
        metadata={
            "help": f"Policy-gradient surrogate, one of {', '.join(POLICY_LOSSES)} (algo/losses.py; register "
            "your own with register_policy_loss): 'ppo_clip' (PPO's token-ratio clip, dual clip on request), "
            "'gspo' (GSPO: length-normalised sequence ratio exp(mean_t log r_t), clipped per sequence; "
            "paper eps 3e-4/4e-4), 'cispo' (CISPO: -sg(clip(r_t)) * A * log pi_t, every token keeps its "
            "gradient), 'soft_sapo' (Soft Adaptive Policy Optimization, TRL's and verl's loss 'sapo', also "
            "accepted as 'sapo_loss': a sigmoid gate on r_t instead of the clip, tau_pos/tau_neg; not sparserl's "
            "SAPO, the swarm sharing of rollouts in distributed.swarm.*, which is why plain 'sapo' is refused), "
            "'clip_cov' and 'kl_cov' (Clip-Cov, KL-Cov: the highest-covariance tokens lose their gradient or pay "
            "a KL; clip_cov_*, kl_cov_ratio, ppo_kl_coef). The clip bounds are eps_low/eps_high."
        },
    )
    eps_low: float = field(
        default=0.2, metadata={"help": "PPO clip: lower bound of the ratio is 1 - eps_low."}
    )
    eps_high: float = field(
        default=0.2,
        metadata={"help": "PPO clip: upper bound of the ratio is 1 + eps_high (clip-higher: > eps_low)."},
    )
    dual_clip_c: float | None = field(
        default=None,
        metadata={"help": "Dual clip: for A < 0 the per-token loss is capped at -c * A (c > 1, e.g. 3.0)."},
    )
    tau_pos: float = field(
        default=1.0,
        metadata={
            "help": "soft_sapo: the gate's temperature where A > 0 (verl's tau_pos; TRL's sapo_temperature_pos is "
            "accepted for it; the paper's 1.0)."
        },
    )
    tau_neg: float = field(
        default=1.05,
        metadata={
            "help": "soft_sapo: the gate's temperature where A <= 0 (verl's tau_neg; TRL's sapo_temperature_neg; the "
            "paper's 1.05: negative updates fade faster off-policy)."
        },
    )
    clip_cov_ratio: float = field(
        default=0.0002,
        metadata={
            "help": "clip_cov: share of the loss-mask tokens whose gradient is cut (verl's default 2e-4)."
        },
    )
    clip_cov_lb: float = field(
        default=1.0,
        metadata={
            "help": "clip_cov: lower bound (exclusive) of the covariance of the tokens drawn (verl's 1.0)."
        },
    )
    clip_cov_ub: float = field(
        default=5.0,
        metadata={
            "help": "clip_cov: upper bound (exclusive) of the covariance of the tokens drawn (verl's 5.0)."
        },
    )
    kl_cov_ratio: float = field(
        default=0.0002,
        metadata={
            "help": "kl_cov: share of the loss-mask tokens, those of largest covariance, that pay the KL."
        },
    )
    ppo_kl_coef: float = field(
        default=1.0,
        metadata={
            "help": "kl_cov: weight of |log pi_theta - log pi_old| on those tokens (verl's ppo_kl_coef)."
        },
    )
    overlong_buffer: int = field(
        default=0,
        metadata={
            "help": "DAPO's overlong reward shaping: a completion longer than its cap minus this many tokens "
            "loses (length - (cap - buffer)) / buffer x overlong_penalty of reward, growing linearly to the "
            "full penalty at the cap. 0: off."
        },
    )
    overlong_penalty: float = field(
        default=1.0,
        metadata={"help": "DAPO's overlong shaping: the penalty at the cap (verl's penalty_factor)."},
    )
    loss_agg_mode: str = field(
        default="seq-mean-token-mean",
        metadata={
            "help": f"Loss aggregation, one of {', '.join(LOSS_AGG_MODES)}: per-sequence token mean then mean over "
            "sequences (the reference), mean over all tokens, or per-sequence token sum / max response length."
        },
    )
    loss_token_norm: int | None = field(
        default=None,
        metadata={
            "help": "seq-mean-token-sum-norm: the constant each sequence's token sum is divided by "
            "(Dr. GRPO: the maximum response length); None: the padded length T of the batch."
        },
    )
    rejected_in_denominator: bool = field(
        default=True,
        metadata={
            "help": "Rejected sequences (all-zero mask) still count in the sequence/token denominator, so "
            "gradients are diluted, not renormalised (the reference). False: divide by kept ones only."
        },
    )
    kl_estimator: str = field(
        default="k3",
        metadata={
            "help": f"KL-to-reference estimator, one of {', '.join(KL_ESTIMATORS)}. 'k3_is': DeepSeek-V3.2's "
            "unbiased estimate, k3 weighted by r_t = pi_theta / pi_old (the PPO anchor; with its gradient), "
            "unbiased off-policy; TRL's use_bias_correction_kl=true."
        },
    )
    kl_coef: float = field(
        default=1e-4,
        metadata={"help": "beta: weight of the KL to the reference (initial) model; 0 disables it."},
    )
    kl_clamp: float = field(
        default=10.0, metadata={"help": "The per-token KL estimate is clamped to [-c, c]."}
    )
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus: loss -= coef * entropy."})
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "DeepSeek-V3.2's off-policy sequence masking (TRL's name; the paper's delta): the policy "
            "term of a token is dropped when its advantage is < 0 and its sequence's mean log(pi_sampler / "
            "pi_theta) over the loss mask exceeds this (TRL suggests 0.5). KL and entropy terms stay. None: off."
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "TRL's name: a completion that hit its length cap (finish 'length') gets loss mask 0, "
            "every term and denominator included."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "TRL's name (the 80/20 paper's rho): the policy term only on the tokens whose entropy is in "
            "the top quantile of the (micro-)batch's loss-mask tokens (>= its (1 - rho) quantile); 1.0: every "
            "token (off), 0.2 the paper's. Computes the learner's token entropies."
        },
    )
    keep_sampling_mask: bool = field(
        default=False,
        metadata={
            "help": "DeepSeek-V3.2's keep-sampling mask: the sampler records each token's top-p/top-k kept set "
            "(V/8 bytes a token) and pi_theta, pi_old and the reference are renormalised over it, so that their "
            "ratios to the sampler compare like with like. Changes nothing (and records nothing) with "
            "rollout.top_p=1 and rollout.top_k=0. Needs whole samples drawn by this step's sampler: not with "
            "rollout.partial, Ray rollout workers, SPEC-RL drafts or swarm-shared groups."
        },
    )
    sampler_kl_coef: float = field(
        default=0.0,
        metadata={
            "help": "SMD's distillation weight lambda (preset smd: the paper's 0.1): loss += lambda * agg(D_t) "
            "over every response token, D_t a divergence of the learner (dense, with gradient) from the "
            "sampler's recorded log-prob of the drawn token, a fixed target (the sparse side gets no gradient, "
            "as the paper's stop-gradient says). 0: off."
        },
    )
    sampler_kl_estimator: str = field(
        default="hinge",
        metadata={
            "help": f"D_t of sampler_kl_coef, one of {', '.join(SAMPLER_KL_ESTIMATORS)}: 'hinge' "
            "max(0, log pi_sparse - log pi_theta), the SMD authors' released code; 'kl' rho log rho - rho + 1, "
            "rho = pi_theta / pi_sparse (log rho clamped to +-log_ratio_clamp): on the sampler's draws an "
            "unbiased estimate of KL(pi_theta || pi_sparse) at each prefix, and its gradient of that KL's."
        },
    )

    def __post_init__(self) -> None:
        if self.rollout_rs:
            if self.correction_mode == "none":
                raise ValueError(
                    f"algo.correction_mode='none' ignores algo.rollout_rs={self.rollout_rs}; "
                    "set algo.correction_mode='decoupled' (or 'bypass') or unset it"
                )
            # idempotent (a bound only tightens), so a saved and reloaded config expands to itself
            for key, value in rollout_rs_overrides(self.rollout_rs).items():
                setattr(self, key, tighter(key, getattr(self, key), value))
        _choice("adv_estimator", self.adv_estimator, ADV_ESTIMATORS)
        if self.policy_loss in REFUSED_POLICY_LOSSES:
            raise ValueError(
                f"algo.policy_loss={self.policy_loss!r}: {REFUSED_POLICY_LOSSES[self.policy_loss]}"
            )
        self.policy_loss = POLICY_LOSS_ALIASES.get(self.policy_loss, self.policy_loss)
        _choice("policy_loss", self.policy_loss, tuple(POLICY_LOSSES))
        _choice("correction_mode", self.correction_mode, CORRECTION_MODES)
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if (
            getattr(POLICY_LOSSES[self.policy_loss], "sequence_level", False)
            and self.loss_agg_mode == "token-mean"
        ):
            warnings.warn(
                f"algo.policy_loss={self.policy_loss!r} takes one ratio per sequence, and algo.loss_agg_mode="
                "'token-mean' weighs each sequence by its length: set algo.loss_agg_mode=seq-mean-token-mean "
                "(the paper's) unless that weighting is meant",
                UserWarning,
                stacklevel=2,
            )
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("sampler_kl_estimator", self.sampler_kl_estimator, SAMPLER_KL_ESTIMATORS)
        if self.correction_mode == "none":
            on = [k for k in CORRECTION_KNOBS if getattr(self, k) not in (None, False)]
            if on:
                raise ValueError(
                    f"algo.correction_mode='none' ignores {', '.join('algo.' + k for k in on)}; "
                    "set algo.correction_mode='decoupled' (or 'bypass') or unset them"
                )
        for name in self.adv_transforms:
            _choice("adv_transforms", name, tuple(ADV_TRANSFORMS))
        check_ranges(self)

    @property
    def needs_entropy(self) -> bool:
        """True when the loss reads the learner's per-token entropy (entropy bonus, top_entropy_quantile)."""
        return self.entropy_coef > 0 or self.top_entropy_quantile < 1.0

    @property
    def needs_recompute(self) -> bool:
        """True when the trainer must recompute dense pi_old with a teacher-forced pass (not in bypass)."""
        return self.correction_mode != "bypass"


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"algo.{key}={value!r} is unknown; choose one of {', '.join(allowed)}")


def canonical_keys(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the keys of KEY_ALIASES renamed to this config's; a key given under both names is an error."""
    out = dict(values)
    for alias, key in KEY_ALIASES.items():
        if alias in out:
            if key in out:
                raise ValueError(f"algo.{alias} and algo.{key} are one key (TRL's and verl's names): set one")
            out[key] = out.pop(alias)
    return out
