"""The uniqueness judges that run the policy model (docs/uniqueness.md): `embedding` (the policy's mean last
hidden state, cosine distance, average-linkage clustering) and `llm` (the policy asked for strategy labels).
Importing this module registers them in sparserl.algo.uniqueness.JUDGES; the trainer does. Both read the
policy from the transform context: `.module`, `.tokenizer`, `.engine`, `.autocast()`."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sparserl.algo.advantages import TransformContext
from sparserl.algo.uniqueness import Judge, agglomerative_labels, first_seen_labels, register_judge
from sparserl.engine.context_length import prompt_fits
from sparserl.engine.module_mode import module_mode
from sparserl.engine.padding import right_pad
from sparserl.models import encode_prompt

EMBED_BATCH = 8  # texts per forward of the embedding judge
SOLUTION_CHARS = 2000  # each solution shown to the LLM judge is cut to this many characters
CACHE_ENTRIES = 4096  # LLM judge answers kept (least recently used dropped)
_LIST = re.compile(r"\[[^\[\]]*\]")  # a flat JSON list


def _policy(ctx: TransformContext, judge: str) -> Any:
    """The trainer's policy resources, or an error naming the judge that needs them."""
    if ctx.policy is None:
        raise ValueError(
            f"shaping.judge={judge!r} needs the policy model: build the transform with the trainer"
        )
    return ctx.policy


def _autocast(policy: Any) -> contextlib.AbstractContextManager:
    """The policy's autocast context (its compute dtype), or none when it has no such method."""
    return policy.autocast() if hasattr(policy, "autocast") else contextlib.nullcontext()


@register_judge("embedding")
class EmbeddingJudge(Judge):
    """Embeds each completion as the policy's last hidden state (after the final norm) averaged over the
    completion's tokens (the text alone, no prompt), then clusters by cosine distance with average linkage,
    merging while the distance is <= `shaping.judge_threshold`. Identical texts always share a cluster."""

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__(ctx)
        self.policy = _policy(ctx, self.name)
        self.threshold = float(ctx.shaping.judge_threshold)

    def cluster(self, texts: list[str]) -> list[int]:
        unique = list(dict.fromkeys(texts))
        if len(unique) == 1:
            return [0] * len(texts)
        unit = F.normalize(self.embed(unique), dim=1)
        distances = (1.0 - unit @ unit.T).clamp(min=0.0)
        labels = dict(zip(unique, agglomerative_labels(distances, self.threshold), strict=True))
        return first_seen_labels([labels[t] for t in texts])

    @torch.no_grad()
    def embed(self, texts: list[str]) -> Tensor:
        """[len(texts), hidden] float64: the mean over each text's tokens of the final hidden state."""
        tok, module = self.policy.tokenizer, self.policy.module
        fallback = tok.eos_token_id if tok.eos_token_id is not None else 0
        ids = [list(row) or [fallback] for row in tok(texts, add_special_tokens=False)["input_ids"]]
        device = module.get_input_embeddings().weight.device
        out = []
        with module_mode(module, training=False), _autocast(self.policy):
            for start in range(0, len(ids), EMBED_BATCH):
                batch, mask = right_pad(ids[start : start + EMBED_BATCH], value=tok.pad_token_id or 0)
                hidden = module.get_decoder()(input_ids=batch.to(device), attention_mask=mask.to(device))
                h, m = hidden.last_hidden_state.double(), mask.to(device)[..., None].double()
                out.append(((h * m).sum(dim=1) / m.sum(dim=1)).cpu())
        return torch.cat(out)


def judge_prompt(texts: list[str]) -> str:
    """The LLM judge's instruction: the solutions numbered, then a request for one JSON list of labels."""
    shown = "\n\n".join(f"### Solution {i}\n{t[:SOLUTION_CHARS]}" for i, t in enumerate(texts))
    return (
        f"Here are {len(texts)} correct solutions to the same problem. Group them by solution strategy: "
        "solutions that follow the same method (the same steps in the same order, whatever the numbers or "
        "wording) get the same label, a different method a different label.\n\n"
        f"{shown}\n\n"
        f"Answer with only a JSON list of {len(texts)} integer labels, one per solution in order: for "
        "instance [0, 1, 0] for three solutions of which the first and the third share a method."
    )


def parse_labels(answer: str, n: int) -> list[int] | None:
    """The first flat JSON list in `answer` as labels 0, 1, ... (entries: integers or strings, equal entries
    one label), or None when there is none, it does not parse, or it has not exactly `n` entries."""
    found = _LIST.search(answer)
    if found is None:
        return None
    try:
        items = json.loads(found.group(0))
    except json.JSONDecodeError:
        return None
    if len(items) != n or not all(isinstance(x, (int, str)) and not isinstance(x, bool) for x in items):
        return None
    return first_seen_labels(items)


def texts_key(texts: list[str]) -> str:
    """A hash of the texts, in order (the LLM judge's cache key)."""
    return hashlib.sha256(json.dumps(texts).encode()).hexdigest()


@register_judge("llm")
class LLMJudge(Judge):
    """Asks the policy itself, greedily (temperature 0) on a dense cache, for a JSON list of strategy labels,
    one per solution (`judge_prompt`, at most `shaping.judge_max_new_tokens` tokens). An answer that does
    not parse, has the wrong length, or a prompt that does not fit the context, is a failure: every
    solution its own cluster (no reweighting), counted in `failures`. Answers are cached by the texts' hash."""

    def __init__(self, ctx: TransformContext) -> None:
        super().__init__(ctx)
        self.policy = _policy(ctx, self.name)
        self.max_new_tokens = int(ctx.shaping.judge_max_new_tokens)
        self.cache: OrderedDict[str, list[int]] = OrderedDict()
        self._engine: Any = None

    def cluster(self, texts: list[str]) -> list[int]:
        key = texts_key(texts)
        if key in self.cache:
            self.cache.move_to_end(key)
            return list(self.cache[key])
        labels = self.ask(texts)
        if labels is None:
            self.failures += 1
            labels = list(range(len(texts)))
        self.cache[key] = labels
        if len(self.cache) > CACHE_ENTRIES:
            self.cache.popitem(last=False)
        return list(labels)

    def ask(self, texts: list[str]) -> list[int] | None:
        """One greedy generation of the judge prompt; its parsed labels, or None."""
        tok, engine = self.policy.tokenizer, self.engine()
        prompt = encode_prompt(tok, [{"role": "user", "content": judge_prompt(texts)}])
        limit = getattr(getattr(engine, "decoder", None), "max_positions", None)
        if not prompt_fits(len(prompt), self.max_new_tokens, limit):
            return None
        out = engine.generate([prompt], n=1, max_new_tokens=self.max_new_tokens, temperature=0.0, seed=0)
        answer = tok.decode(list(out[0].completion_ids), skip_special_tokens=True)
        return parse_labels(answer, len(texts))

    def engine(self) -> Any:
        """The policy's rollout engine when its cache is dense, else a dense engine over the same model (built
        once): the judge reads whole solutions, not what a sparse cache kept of them."""
        if self._engine is None:
            engine = self.policy.engine
            kv = getattr(engine, "kv", None)
            if kv is not None and kv.sparse:
                from sparserl.engine import RolloutEngine

                engine = RolloutEngine(self.policy.module, self.policy.tokenizer, dtype=engine.decoder.dtype)
            self._engine = engine
        return self._engine
