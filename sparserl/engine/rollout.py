"""The rollout engine: batched sampling on our own KV cache (dense, evicted to a budget, or read block-sparse),
with sampler log-probs."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from sparserl.engine.cache import KVCache
from sparserl.engine.compression import make_evictor
from sparserl.engine.context_length import prompt_fits
from sparserl.engine.decoder import Decoder, prefill_attention
from sparserl.engine.decoding import DecodeRun, Request, Sampling
from sparserl.engine.evicting_prefix import EvictingPrefixCache
from sparserl.engine.kv_config import KVConfig
from sparserl.engine.module_mode import module_mode
from sparserl.engine.padding import right_pad
from sparserl.engine.prefill_reuse import reused
from sparserl.engine.sampling import DistributionRecorder, TokenDistributions, check_distribution_request
from sparserl.engine.sparse_attention import make_sparse_attention


@dataclass
class Sample:
    """One sampled completion. `logprobs[t]` is log p_sampler(token t) under the processed distribution;
    `distributions` holds that distribution's top-k (and all of it) per token when `generate` was asked."""

    prompt_index: int
    completion_ids: list[int]
    logprobs: Tensor
    finish_reason: str
    stats: dict[str, float] = field(default_factory=dict)
    distributions: TokenDistributions | None = None


@dataclass
class Rollouts:
    """The samples of one `generate` call (the n samples of prompt i contiguous) and the call's statistics."""

    samples: list[Sample]
    stats: dict[str, float]

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


def eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids.update(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    return ids


# engine.compile=auto: compile when a run decodes at least this many steps (trainer.steps x max_new_tokens) on a
# model of at least AUTO_COMPILE_MIN_PARAMS. Measured (benchmarks/decode_step.py, docs/results/decode_step.json,
# SmolLM2-135M, one CPU thread, a cold compile cache): one graph compiles in 29-42 CPU-s and saves 28-70 ms a
# step, so it pays after 570-1400 steps (974 for the default run's R-KV batch of 32); a run whose rows finish at
# different lengths compiles up to four graphs (its batch, half, a quarter, ..., 4 rows), each used for part of
# the steps, hence twice the single graph's break-even. The default run (512 steps) and benchmarks/rl_step.py
# (256) stay eager; with torch's compile cache warm (the same graphs compiled before on this machine) a graph
# costs ~5 s and compiling would pay after ~150 steps, which auto does not assume.
AUTO_COMPILE_MIN_STEPS = 2000
AUTO_COMPILE_MIN_PARAMS = 50_000_000  # tiny and test models: a compile of 10-20 s for a step of a few ms


def resolve_compile(
    setting: bool | str, model: nn.Module, kv: KVConfig | None, decode_steps: int
) -> tuple[bool, str]:
    """engine.compile's value for a run of `decode_steps` decode steps (true, false or auto) and why."""
    import shutil

    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"engine.compile={setting!r}: choose true, false or auto")
    if setting != "auto":
        return bool(setting), f"engine.compile={str(setting).lower()}"
    params = sum(p.numel() for p in model.parameters())
    on_cpu = next(model.parameters()).device.type == "cpu"
    why = (
        f"kv.method={kv.method}: its eager attention islands are not measured to pay"
        if kv is not None and kv.sparse_attention
        else "no C++ compiler for torch.compile on CPU" if on_cpu and not (shutil.which("g++") or shutil.which("c++"))
        else f"a model of {params / 1e6:.1f}M parameters (< {AUTO_COMPILE_MIN_PARAMS // 10**6}M)"
        if params < AUTO_COMPILE_MIN_PARAMS
        else f"{decode_steps} decode steps in the run (< {AUTO_COMPILE_MIN_STEPS})"
        if decode_steps < AUTO_COMPILE_MIN_STEPS
        else None
    )  # fmt: skip
    if why is not None:
        return False, f"engine.compile=auto: eager decode step ({why})"
    return True, f"engine.compile=auto: compiled decode step ({decode_steps} decode steps in the run)"


# A model's sparse-path switch (DistillSparse: an adapter on only while sampling sparse), entered by every sparse
# engine over that model for the length of a run. Kept beside the model, not on it, so copies (exports) are dense.
_SPARSE_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_sparse_path(model: nn.Module, switch: Callable[[], AbstractContextManager]) -> None:
    """Make every sparse `RolloutEngine` over `model` sample inside `switch()` (dense engines never do)."""
    _SPARSE_PATHS[model] = switch


class RolloutEngine:
    """Samples n completions per prompt. The KV cache is preallocated and, with an eviction method, bounded.

    A prompt is prefilled once (dense). With `share_prompts` (default) and an eager cache, a group's prompt KV is
    held once and read by its n samples (`engine/shared_prefix.py`; evicting samples each keep a mask over it,
    `engine/evicting_prefix.py`; H2O's per-slot state keeps copies); else it is copied to each. `dtype` is the
    compute dtype of the rollout and its KV cache (default: the weights' own; bfloat16 over float32 weights runs a
    bfloat16 copy).
    With `compile`, the decode step runs through `torch.compile` with static shapes (the live rows padded to a
    bucket of rows, attention over the whole preallocated capacity: one graph per (bucket, capacity), see
    `DecodeRun._compiled_step`), so that on CUDA it can be captured in a graph; the tokens and log-probs are the
    eager step's (tested), dense or evicting (the cut itself, every `kv.interval` steps, stays eager: its
    shapes vary with the rows due and their lengths). Block-sparse attention (its page choice and the attention
    over the pages read: data-dependent shapes) runs as an eager island inside the compiled step
    (`PageSparseAttention.attend`). With `kv.method` an eviction
    method, a prompt longer than `kv.budget` is cut to the budget right after prefill, and during decoding every
    `kv.interval` steps each sequence holding `budget` or more positions is cut back so that it holds exactly
    `budget` after the step's token is written: no row ever holds more than `budget + interval - 1` positions.
    With `kv.method` a block-sparse method (block_topk) the cache is kept whole and each decode step reads, per
    layer and KV head, only the budget's worth of pages. With `kv.schedule`, each sequence's budget is re-read at
    every decode step from its current length (`step_budget` holds the last step's, per cache row).

    Each of `step_hooks` (added for a while with `with engine.step_hook(fn):`, chained, never replaced) is
    called after every decode step as `fn(step, cache, samples)` (`samples[r]` is the sample index of cache row
    r): a read-only window on the cache for recording and
    instrumentation.

    A sparse engine over a model with a registered sparse path (`register_sparse_path`) samples inside it.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        kv: KVConfig | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        share_prompts: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = Decoder(model, dtype)
        self.kv = kv or KVConfig()
        # static shapes: (rows padded to a bucket, capacity); attention spans the whole capacity. On a GPU the
        # compiled step is also captured as a CUDA graph (one launch a step instead of one per kernel): the step
        # writes the cache in place, so `DecodeRun` marks the cache's tensors as static addresses (the graph
        # then writes into them; a reallocated cache, another address, records a new graph) and copies the
        # logits out before the next replay overwrites them
        self.cuda_graphs = compile and next(model.parameters()).device.type == "cuda"
        mode = "reduce-overhead" if self.cuda_graphs else None
        self.compiled_step = torch.compile(self._decode_step, dynamic=False, mode=mode) if compile else None
        if compile:  # every engine's graphs count against one limit (per code object; 8 by default), beyond
            # which dynamo silently runs eagerly: a few buckets x capacities x KV methods x models must fit
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.compiled_shapes: set[tuple[int, int]] = set()  # (rows, capacity) graphs compiled so far
        self.notify: Callable[[str], None] | None = None  # told when a graph compiles (the trainer's console)
        self._compiling: tuple[str, float] | None = None
        self.evictor = make_evictor(self.kv, self.decoder.scale) if self.kv.evicting else None
        switch = _SPARSE_PATHS.get(model) if self.kv.sparse else None
        self.sampling_context: Callable[[], AbstractContextManager] = switch or nullcontext
        self.sparse = (
            make_sparse_attention(self.kv, self.decoder.num_layers) if self.kv.sparse_attention else None
        )
        # a prompt held once is read by a data-dependent number of row groups: eager decode steps only; evicting
        # rows keep their own bounded sets, part of them in the prompt held once, unless the method keeps
        # per-slot state (`EvictingPrefixCache`)
        # a quantized cache copies prompts: the shared prefix's attention reads full-precision keys and values
        shareable = self.evictor is None or EvictingPrefixCache.supports(self.evictor.method)
        self.share_prompts = share_prompts and shareable and not compile and not self.kv.quantized
        self.schedule = self.kv.budget_schedule
        self.step_budget: Tensor | None = None
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.step_hooks: list[Callable[[int, KVCache, Tensor], None]] = []

    def note_compile(self, rows: int, capacity: int) -> None:
        """Before a compiled step: a shape not seen yet compiles now (seconds to a minute): say so."""
        if (rows, capacity) in self.compiled_shapes:
            return
        self.compiled_shapes.add((rows, capacity))
        what = f"{rows} rows x {capacity} cache slots"
        if self.notify is not None:
            self.notify(f"engine.compile: compiling the decode step for {what} (once per shape)...")
        self._compiling = (what, time.perf_counter())

    def note_compiled(self) -> None:
        """After a compiled step: how long the compile that `note_compile` announced took."""
        if self._compiling is not None:
            what, t0 = self._compiling
            self._compiling = None
            if self.notify is not None:
                self.notify(
                    f"engine.compile: decode step for {what} compiled in {time.perf_counter() - t0:.0f} s"
                )

    @contextmanager
    def step_hook(self, fn: Callable[[int, KVCache, Tensor], None] | None) -> Iterator[None]:
        """Call `fn` after every decode step while the block runs, after the hooks already there (None: no-op)."""
        if fn is not None:
            self.step_hooks.append(fn)
        try:
            yield
        finally:
            if fn is not None:
                self.step_hooks.remove(fn)

    def _check(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        sampling: tuple[float, float, int, list[str]],
        keys: list[int],
    ) -> None:
        if not prompt_ids:
            raise ValueError("generate: the prompt list is empty")
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"generate: n ({n}) and max_new_tokens ({max_new_tokens}) must be >= 1")
        temperature, top_p, top_k, stop = sampling
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(
                f"generate: need temperature >= 0 (0 = greedy), 0 < top_p <= 1, top_k >= 0 (0 = off); "
                f"got temperature={temperature}, top_p={top_p}, top_k={top_k}"
            )
        if any(not s for s in stop):
            raise ValueError(f"generate: stop strings must be non-empty, got {stop!r}")
        if len(keys) != len(prompt_ids) * n or any(not isinstance(k, int) or k < 0 for k in keys):
            raise ValueError(
                f"generate: sample_keys must be {len(prompt_ids) * n} integers >= 0 (one per sample), got {keys!r}"
            )
        limit = self.decoder.max_positions
        vocab = self.decoder.model.get_input_embeddings().weight.shape[0]
        for i, p in enumerate(prompt_ids):
            if isinstance(p, str):
                raise ValueError(
                    f"generate: prompt {i} is a string; pass token ids (see models.encode_prompt)"
                )
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"generate: prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})"
                )
            if not prompt_fits(len(p), max_new_tokens, limit):
                raise ValueError(
                    f"generate: prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                    f"the model's context of {limit} positions"
                )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int = 1,
        max_new_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | str | None = None,
        seed: int = 0,
        top_logprobs: int = 0,
        full_logprobs: bool = False,
        sample_keys: Sequence[int] | None = None,
    ) -> Rollouts:
        """Sample `n` completions for each prompt (token ids, chat template already applied).

        Sample i (prompt-major: prompt i // n) draws its tokens from uniform numbers that depend only on
        (`seed`, `sample_keys[i]`, the step), by default its index i in this call. Stable keys (say, from a
        prompt id and a sample index) make a sample's tokens independent of which others share its batch.

        `top_logprobs=k` (and `full_logprobs=True`) also return, per generated token, the k most likely ids and
        their log-probs (and all V log-probs) of the processed distribution sampled from, in
        `Sample.distributions`; off by default, nothing is computed then. The samples drawn do not change.
        """
        stop = [stop] if isinstance(stop, str) else list(stop or [])  # one string is one stop, not its chars
        keys = list(range(len(prompt_ids) * n)) if sample_keys is None else list(sample_keys)
        self._check(prompt_ids, n, max_new_tokens, (temperature, top_p, top_k, stop), keys)
        check_distribution_request(top_logprobs, self.decoder.model.lm_head.out_features, "generate")
        recorder = DistributionRecorder.maybe(
            len(prompt_ids) * n, max_new_tokens, top_logprobs, full_logprobs, self.decoder.device
        )
        with self.decoding():
            rollouts = self._generate(
                prompt_ids, n, max_new_tokens, temperature, top_p, top_k, stop, seed, keys, recorder
            )
        if recorder is not None:
            recorder.attach(rollouts.samples)
        return rollouts

    def _generate(
        self, prompt_ids, n, max_new_tokens, temperature, top_p, top_k, stop, seed, keys, recorder=None
    ) -> Rollouts:
        """A static batch: every sample admitted at once (one prefill per prompt), decoded until all finish."""
        requests = [
            Request(list(prompt_ids[i // n]), key, seed, max_new_tokens) for i, key in enumerate(keys)
        ]
        run = self.start_run(requests, Sampling(temperature, top_p, top_k, stop), recorder, seed=seed)
        run.admit(list(range(len(requests))))
        while run.running:
            run.step()
        return self._collect(run, n)

    def start_run(
        self,
        requests: list[Request],
        sampling: Sampling,
        recorder: DistributionRecorder | None = None,
        kv_memory_cap: int | None = None,
        seed: int = 0,
    ) -> DecodeRun:
        """A decoding run over `requests` (the caller admits, steps and retires; see engine/decoding.py);
        `seed` seeds stateful eviction methods. Call inside `decoding()` so that the packed weights exist."""
        if self.evictor is not None:
            self.evictor.method.start(seed)
        return DecodeRun(self, requests, sampling, recorder, kv_memory_cap)

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """The model in eval mode with the packed weights built, for the duration of a run; restored after."""
        with module_mode(self.model, training=False):
            try:
                with torch.no_grad(), self.sampling_context():
                    self.decoder.prepare()
                    yield
            finally:
                self.decoder.release()

    def prefilled(
        self, inputs: list[list[int]], lengths: Tensor, extras: tuple[str, ...]
    ) -> tuple[KVCache, Tensor]:
        """A small cache of `inputs` prefilled densely (before any cut or page summary), and their next-token
        logits: the same under every budget of a method, so a calibration's candidates reuse it (prefill_reuse)."""
        dec, dev = self.decoder, lengths.device

        def dense() -> tuple[KVCache, Tensor]:
            tmp = KVCache(dec.num_layers, len(inputs), dec.num_kv_heads, dec.num_heads, dec.head_dim,
                          int(lengths.max()), self.kv.window, dec.dtype, dev, extras=extras)  # fmt: skip
            return tmp, self._prefill(inputs, lengths, tmp)

        key = ("decode", id(self.model), dec.dtype, dev, self.kv.method, self.kv.window, *map(tuple, inputs))
        return reused(key, dense, lambda kept: (kept[0].clone(), kept[1].clone()))

    def _prefill(self, prompt_ids, prompt_len: Tensor, cache: KVCache) -> Tensor:
        """Dense forward over the right-padded prompts, filling the cache; returns next-token logits [P, V]."""
        dec, dev = self.decoder, self.decoder.device
        p, t = len(prompt_ids), int(prompt_len.max())
        ids = right_pad(prompt_ids, value=self.tokenizer.pad_token_id or 0, width=t)[0].to(dev)
        valid = torch.arange(t, device=dev)[None, :] < prompt_len[:, None]
        positions = torch.arange(t, device=dev)[None, :].expand(p, t)
        hidden = dec.embed(ids)
        rope = dec.rope(hidden, positions)
        w = self.kv.window
        last = (prompt_len[:, None] - w + torch.arange(w, device=dev)[None, :]).clamp(min=0)  # [P, w]
        observe = self.evictor is not None and self.evictor.method.needs_prefill_attention
        for layer in range(dec.num_layers):
            qkv = dec.qkv(layer, hidden, rope)
            out = prefill_attention(qkv, valid)
            if observe:  # probabilities on the side: the output stays the dense path's, bit for bit
                self.evictor.method.observe_prefill(cache, layer, prefill_probs(qkv, valid, dec.scale))
            cache.fill(layer, qkv.k, qkv.v, positions, prompt_len)
            q_last = qkv.q.gather(2, last[:, None, :, None].expand(-1, dec.num_heads, -1, dec.head_dim))
            cache.queries[layer].scatter_(2, (last % w)[:, None, :, None].expand_as(q_last), q_last)
            hidden = dec.finish_layer(layer, hidden, out)
        cache.query_count.copy_(prompt_len)
        return dec.logits(hidden[torch.arange(p, device=dev), prompt_len - 1])

    def _decode_step(self, tok: Tensor, positions: Tensor, cache: KVCache, span: int = 0) -> Tensor:
        """Feed one token per row at its true position; returns next-token logits [rows, V]. Attention reads
        the first `span` slots of every row (default: up to the longest row's)."""
        dec = self.decoder
        hidden = dec.embed(tok[:, None])
        rope = dec.rope(hidden, positions[:, None])
        span = span or int(cache.length.max()) + 1
        valid = cache.valid(span, extra=1)
        if self.sparse is not None:
            self.sparse.begin_step(positions + 1, self.step_budget)
        for layer in range(dec.num_layers):
            qkv = dec.qkv(layer, hidden, rope)
            cache.write(layer, qkv.k, qkv.v, positions)
            if self.sparse is not None and layer in self.sparse.sparse_layers:
                k, v = cache.view(layer, span)
                out, probs = self.sparse.attend(cache, layer, qkv.q, k, v, valid, dec.scale)
            else:
                out, probs = cache.attend(layer, qkv.q, valid, span, dec.scale)
            if self.evictor is not None:
                cache.remember_queries(layer, qkv.q)
                self.evictor.method.observe(cache, layer, probs, span)
            hidden = dec.finish_layer(layer, hidden, out)
        cache.advance()
        cache.query_count += 1
        return dec.logits(hidden[:, 0])

    def _collect(self, run: DecodeRun, n: int) -> Rollouts:
        samples = []
        position_stats = run.positions.sample_stats()
        for i in range(len(run.requests)):
            tokens, logps = run.completion(i)
            stats = {**position_stats[i], "compression_events": int(run.events[i])}
            samples.append(Sample(i // n, tokens, logps, run.finish[i] or "length", stats))
        return Rollouts(samples, run_stats(run))


def run_stats(run: DecodeRun) -> dict[str, float]:
    """A decoding run's totals: tokens, throughput, positions held and read, KV bytes, eviction, timings."""
    generated = int((run.count - run.start_count).sum())
    t = run.timing
    wall = t["prefill_s"] + t["decode_s"]
    return {
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "generated_tokens": float(generated),
        **run.positions.summary(),
        "peak_kv_bytes": float(run.peak_bytes),
        "peak_dense_kv_bytes": float(run.dense_bytes),
        "peak_kv_transient_bytes": float(run.peak_transient_bytes),
        "kv_bytes_per_position": float(run.bytes_per_position),
        "compression_events": float(run.events.sum()),
        "fork_prefills": float(run.fork_prefills),
        **t,
    }


def prefill_probs(qkv, valid: Tensor, scale: float) -> Tensor:
    """Causal prefill attention probabilities [P, Hkv, G, T, T] (for H2O); padding query rows are zero."""
    p, hq, t, d = qkv.q.shape
    hkv = qkv.k.shape[1]
    q = qkv.q.view(p, hkv, hq // hkv, t, d)
    scores = torch.matmul(q, qkv.k[:, :, None].transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    mask = causal[None, None, None] & valid[:, None, None, None, :]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32)
    return probs * valid[:, None, None, :, None]
