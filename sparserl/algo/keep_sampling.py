"""DeepSeek-V3.2's keep-sampling mask: the sampler's top-p / top-k truncation applied to the learner's
distributions, so that pi_theta and pi_old are renormalised over the same kept set of tokens the sampler drew
from (its recorded log-probs already are) and the importance ratio compares like with like.

Renormalising needs the learner's whole next-token distribution at every position (the mass it puts on the
kept set). The update here scores the drawn tokens' log-probs only (`engine.scoring.completion_logprobs`), so
`algo.keep_sampling_mask=true` is refused with NotImplementedError. What is exact with the distributions at
hand is below: the kept set from the sampler's recorded distribution (`Sample.distributions` with
`full_logprobs=True` holds the processed log-probs, -inf where top-k / top-p removed a token), and the learner's
log-prob of the drawn token renormalised over it.
"""

from __future__ import annotations

from torch import Tensor

from sparserl.errors import UserError

KEEP_SAMPLING_REFUSAL = (
    "algo.keep_sampling_mask=true is not available: renormalising pi_theta and pi_old over the sampler's "
    "top-p/top-k kept set needs the learner's full next-token distributions, and the update scores only the "
    "drawn tokens' log-probs. Leave it off (with rollout.top_p=1 and rollout.top_k=0 the sampler keeps every "
    "token and the mask changes nothing); sparserl.algo.keep_sampling.keep_sampling_logprobs does it where both "
    "distributions are at hand"
)


class NotAvailableInUpdate(UserError, NotImplementedError):
    """A knob whose method needs what the update does not have (the CLI prints it as one line)."""


def kept_set(sampler_logprobs: Tensor) -> Tensor:
    """The sampler's kept set, bool [..., V]: the ids its processed distribution [..., V] gives any mass."""
    return sampler_logprobs > float("-inf")


def keep_sampling_logprobs(logits: Tensor, kept: Tensor, tokens: Tensor) -> Tensor:
    """log pi(o_t) renormalised over the kept set: log_softmax of `logits` [..., V] (after the sampler's
    temperature) with the ids outside `kept` at -inf, taken at `tokens` [...]; -inf for a token outside it."""
    masked = logits.float().masked_fill(~kept, float("-inf"))
    return masked.log_softmax(dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
