"""Measuring the hardware's arithmetic intensity I (FLOPs per byte) and the engine's real decode step.

I = achieved FLOP/s of the decode step's matmuls (one layer's seven projections at the batch size, weights hot
in cache) / achieved read bandwidth of a reduction over a buffer far larger than the caches. With it,
FLOPs + I x bytes is a step's time in units of one matmul FLOP.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sparserl.cost.shape import CostInputError, ModelShape, torch_dtype
from sparserl.engine.kv_config import KVConfig

# CPU entries: medians of 5 runs of `sparserl cost --probe --threads T` (SmolLM2-135M shapes, batch 16, float32)
# on this project's machine, 2 cores of an Intel Xeon @ 2.80GHz (AVX-512, 48 MiB L3) both busy with other work.
# GPU entries: datasheet bf16 dense tensor-core peak / HBM bandwidth. See docs/cost_model.md.
INTENSITY_PRESETS = {
    "cpu-1t": 3.3,
    "cpu-2t": 1.6,
    "h100": 989e12 / 3.35e12,
    "h200": 989e12 / 4.8e12,
}
POSITION_STATS = ("read_positions_mean", "read_positions_peak", "held_positions_mean")
LAYER_PASSES = 10  # one timing = 10 passes over a SmolLM2 layer's matmuls: ~0.05-0.1 s, as long as one read


@dataclass
class IntensityProbe:
    """One probe: the medians of interleaved timings. `intensity` is the median of the paired ratios (a matmul
    timed next to a read), so a machine whose speed drifts with other load slows both sides of a pair alike."""

    threads: int
    dtype: str
    batch: int
    matmul_flops_per_s: float
    read_bytes_per_s: float
    copy_bytes_per_s: float
    intensity: float


def resolve_intensity(text: str) -> float:
    """A number of FLOPs per byte, or a preset name."""
    if text in INTENSITY_PRESETS:
        return INTENSITY_PRESETS[text]
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise CostInputError(
            f"--intensity {text!r} must be a finite positive number (FLOPs per byte) or one of "
            f"{', '.join(INTENSITY_PRESETS)}"
        )
    return value


def seconds(fn: Callable[[], object]) -> float:
    """Wall time of one call of `fn()`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def probe_intensity(
    shape: ModelShape,
    batch: int = 16,
    threads: int = 1,
    dtype: str = "float32",
    buffer_mib: int = 512,
    repeats: int = 15,
) -> IntensityProbe:
    """Time one layer's decode matmuls at `batch` rows (LAYER_PASSES passes, ~0.1 s like one read) and a read / copy of a
    `buffer_mib` buffer, interleaved, `repeats` times on `threads` torch threads (restored afterwards)."""
    if min(batch, threads, buffer_mib, repeats) < 1:
        raise CostInputError(f"probe: --n ({batch}), --threads ({threads}), buffer, repeats must be >= 1")
    element = torch_dtype(dtype)
    h, m = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    projections = [(q, h), (kv, h), (kv, h), (h, q), (m, h), (m, h), (h, m)]  # q, k, v, o, gate, up, down
    weights = [torch.randn(out, inp, dtype=element) for out, inp in projections]
    inputs = {size: torch.randn(batch, size, dtype=element) for size in {h, q, m}}
    layer_flops = sum(2 * batch * w.numel() for w in weights)

    def layer() -> None:
        for _ in range(LAYER_PASSES):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

    source = torch.ones(buffer_mib * 2**20 // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    size = source.numel() * source.element_size()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for warmup in (layer, source.sum, lambda: target.copy_(source)):
            warmup()
        pairs = [
            (layer_flops * LAYER_PASSES / seconds(layer), size / seconds(source.sum)) for _ in range(repeats)
        ]
        copy = statistics.median(2 * size / seconds(lambda: target.copy_(source)) for _ in range(repeats))
    finally:
        torch.set_num_threads(previous)
    flops, reads = zip(*pairs, strict=True)
    intensity = statistics.median(f / r for f, r in pairs)
    return IntensityProbe(
        threads, dtype, batch, statistics.median(flops), statistics.median(reads), copy, intensity
    )


@dataclass
class StepTimes:
    """Seconds per decode step, one entry per timed generation: wall clock and this process's CPU time (with one
    thread, CPU time leaves out the waits for a core that other processes cause), and the positions each
    generation read per step (mean, peak) and held (the engine's position statistics)."""

    wall: list[float]
    cpu: list[float]
    positions: list[dict[str, float]] = field(default_factory=list)


def check_timing_request(prompt_lens: list[int], steps: int, repeats: int) -> None:
    """Refuse a decode timing that cannot clock a step (before any model is loaded)."""
    if steps < 3 or repeats < 1 or not prompt_lens or min(prompt_lens) < 1:
        raise CostInputError("--probe-decode needs prompt lengths >= 1, --decode-steps >= 3, --repeats >= 1")


def time_decode_steps(
    model, tokenizer, prompt_lens: list[int], kvs: list[KVConfig], batch: int, steps: int, threads: int,
    repeats: int, compile: bool = False, share_prompts: bool = True,
) -> dict[tuple[str, int], StepTimes]:  # fmt: skip
    """Per (kv.method, prompt length), the engine's decode step time on `model` (`batch` samples of one random
    prompt, `steps` new tokens, EOS ignored), clocked between the step-hook calls that end the decode steps, so
    the prefill is left out: the steps timed are those at contexts length + 2 ... length + steps - 1. Lengths
    and methods alternate so that a drifting machine hits all alike. With `compile`, the engines run
    `engine.compile=true` (each cache size compiles once, before the first step clocked). `share_prompts`: the
    batch reads the prompt held once (the engine's default for a group), or, False, every row holds its own copy
    (what rows whose long context is their own generation cost)."""
    from sparserl.engine import RolloutEngine
    from sparserl.engine.prefill_reuse import reusing_prefills

    check_timing_request(prompt_lens, steps, repeats)
    clocks: list[tuple[float, float]] = []
    engines = [
        RolloutEngine(model, tokenizer, kv=kv, compile=compile, share_prompts=share_prompts) for kv in kvs
    ]
    for engine in engines:
        engine.eos_ids = set()
        engine.step_hooks.append(lambda *_: clocks.append((time.perf_counter(), time.process_time())))
    vocab = model.get_input_embeddings().weight.shape[0]
    times = {(kv.method, length): StepTimes([], []) for kv in kvs for length in prompt_lens}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for repeat in range(repeats):
            for length in prompt_lens:
                prompt = torch.randint(vocab, (length,), generator=torch.Generator().manual_seed(repeat))
                with reusing_prefills():  # arms of one method share the prompt's prefill (it is not clocked)
                    for engine in engines:
                        clocks.clear()
                        out = engine.generate([prompt.tolist()], n=batch, max_new_tokens=steps, seed=repeat)
                        (wall0, cpu0), (wall1, cpu1) = clocks[0], clocks[-1]
                        step = times[engine.kv.method, length]
                        step.wall.append((wall1 - wall0) / (len(clocks) - 1))
                        step.cpu.append((cpu1 - cpu0) / (len(clocks) - 1))
                        step.positions.append({k: out.stats[k] for k in POSITION_STATS})
    finally:
        torch.set_num_threads(previous)
    return times
