"""A quantized KV cache: keys and values held as int8 or fp8 (e4m3) with one float32 scale per position and KV
head, dequantized where a decode step reads them. It composes with every eviction method (they score dequantized
keys and keep slots with their scales) and with block-sparse reads (only the pages read are dequantized).

What is exact and what is not: prefill attention runs on the unquantized keys and values (as the dense engine),
and so do an evicting method's cut of the prompt and block-sparse reads' summaries of the prompt's pages; every
decode step reads the quantized cache. The sampler's recorded log-probs are those of the distribution it drew
from (the quantized reads), so the corrections see the quantization error like any other sampler mismatch.

Why not a library's quantized cache: transformers' `QuantizedCache` (quanto/HQQ) grows by concatenation and keeps
a full-precision residual window, and holds no evicted, per-head-ragged rows with their true positions.
"""

from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from sparserl.engine.cache import KVCache, gather_slots
from sparserl.engine.decoder import masked_probs

KV_QUANTS = ("none", "int8", "fp8")
CHUNK = 512  # slots converted at a time for every row and head together (off the CPU)
SLAB = 2048  # slots converted at a time for one row and head on the CPU: 512 KB of float32 at head_dim 64


@dataclass(frozen=True)
class KVCodec:
    """How one position's head vector [D] is stored: `storage` dtype codes and a scale absmax / `top`.

    int8: codes round(x / scale) in [-127, 127], error <= scale / 2 per element. fp8: x / scale cast to e4m3 (3
    mantissa bits), stored as its bytes (uint8: CPU indexing has no float8 kernels), relative error <= 2^-4 and
    absolute <= scale * 2^-10 near zero (e4m3's subnormal step is 2^-9)."""

    name: str
    storage: torch.dtype
    top: float

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Codes [..., D] and scales [...] of x [..., D] (an all-zero vector: scale 0, codes 0)."""
        scale = x.float().abs().amax(dim=-1) / self.top
        safe = torch.where(scale > 0, scale, 1.0)[..., None]
        scaled = x.float() / safe
        if self.name == "int8":
            return scaled.round().clamp(-self.top, self.top).to(torch.int8), scale
        return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale

    def codes(self, data: Tensor, dtype: torch.dtype) -> Tensor:
        """The stored codes as numbers of `dtype` (unscaled). fp8 bytes are looked up in a 256-entry table of
        their values: on the CPU 3.6x faster than torch's float8 conversion, the same numbers (tested)."""
        if self.name == "fp8":
            table = _fp8_table(dtype, data.device)
            return table.index_select(0, data.reshape(-1).int()).view(data.shape)
        return data.to(dtype)

    def decode(self, data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
        """Dequantized values [..., D] of codes [..., D] and scales [...]."""
        return (self.codes(data, torch.float32) * scale[..., None]).to(dtype)


@functools.cache
def _fp8_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """The value of every e4m3 byte in `dtype` (its two NaN codes as 0: the encoder never writes them)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0.0)
    return values.to(dtype=dtype, device=device)


CODECS = {
    "int8": KVCodec("int8", torch.int8, 127.0),
    "fp8": KVCodec("fp8", torch.uint8, torch.finfo(torch.float8_e4m3fn).max),
}


class QuantizedKVCache(KVCache):
    """A `KVCache` whose `k`/`v` hold codes and `k_scale`/`v_scale` [rows, Hkv, capacity] their scales; `view`,
    `gather`, `slot_keys` and `eviction_slots` return dequantized keys and values in the compute dtype, and
    `attend` reads the codes chunk by chunk with the scales folded into the scores and probabilities."""

    def __init__(self, *args, quant: str, **kwargs):
        self.codec = CODECS[quant]
        super().__init__(*args, **kwargs)

    def _new_kv(self, layer: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.compute_dtype = dtype
        for part in ("k", "v"):
            self._store[f"{part}.{layer}"] = torch.zeros(shape, dtype=self.codec.storage, device=device)
            self._store[f"{part}s.{layer}"] = torch.zeros(shape[:3], dtype=torch.float32, device=device)

    def _views(self) -> None:
        super()._views()
        s, n, layers = self._store, self._rows, range(self.num_layers)
        self.k_scale = [s[f"ks.{i}"][:n] for i in layers]
        self.v_scale = [s[f"vs.{i}"][:n] for i in layers]

    def _slot_axis(self, name: str) -> int | None:
        return 2 if name.startswith(("ks.", "vs.")) else super()._slot_axis(name)

    def _slot_tensors(self, layer: int) -> list[Tensor]:
        return [*super()._slot_tensors(layer), self.k_scale[layer], self.v_scale[layer]]

    def mark_static_addresses(self) -> None:
        super().mark_static_addresses()
        for t in [*self.k_scale, *self.v_scale]:
            torch._dynamo.mark_static_address(t, guard=False)

    def nbytes(self) -> int:
        scales = sum(t.numel() * t.element_size() for n, t in self._store.items() if n[:3] in ("ks.", "vs."))
        return super().nbytes() + scales

    def bytes_per_position(self) -> int:
        _, h, _, d = self.k[0].shape
        return 2 * self.num_layers * h * (d * self.k[0].element_size() + self.k_scale[0].element_size())

    def full_precision_bytes_per_position(self) -> int:
        _, h, _, d = self.k[0].shape
        return 2 * self.num_layers * h * d * torch.empty(0, dtype=self.compute_dtype).element_size()

    def _put(self, layer: int, index: tuple, k: Tensor, v: Tensor) -> None:
        for part, x in (("k", k), ("v", v)):
            data, scale = self.codec.encode(x)
            getattr(self, part)[layer][index] = data
            getattr(self, f"{part}_scale")[layer][index] = scale

    def fill(self, layer: int, k: Tensor, v: Tensor, positions: Tensor, lengths: Tensor) -> None:
        t = k.shape[2]
        self._put(layer, (slice(None), slice(None), slice(0, t)), k, v)
        self.pos[layer][:, :, :t] = positions.to(torch.int32)[:, None, :]
        self.length.copy_(lengths)

    def write(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> None:
        rows = torch.arange(self.rows, device=k.device)
        self._put(layer, (rows, slice(None), self.length), k[:, :, 0], v[:, :, 0])
        self.pos[layer][rows, :, self.length] = positions.to(torch.int32)[:, None]

    def view(self, layer: int, span: int) -> tuple[Tensor, Tensor]:
        """Dequantized keys and values of the first `span` slots (a copy)."""
        dt, c = self.compute_dtype, self.codec
        return (
            c.decode(self.k[layer][:, :, :span], self.k_scale[layer][:, :, :span], dt),
            c.decode(self.v[layer][:, :, :span], self.v_scale[layer][:, :, :span], dt),
        )

    def gather(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        dt, c, idx = self.compute_dtype, self.codec, slots.long()
        return tuple(
            c.decode(gather_slots(data[layer], idx), scale[layer].gather(2, idx), dt)
            for data, scale in ((self.k, self.k_scale), (self.v, self.v_scale))
        )

    def slot_keys(self, layer: int, rows: Tensor, slots: Tensor) -> Tensor:
        heads = torch.arange(self.k[layer].shape[1], device=rows.device)[None, :, None]
        at = (rows[:, None, None], heads, slots[:, None, :])
        return self.codec.decode(self.k[layer][at], self.k_scale[layer][at], self.compute_dtype)

    def eviction_slots(
        self, layer: int, rows: Tensor | slice
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
        keys, positions, extras, length = super().eviction_slots(layer, rows)
        scale = self.k_scale[layer][rows, :, : keys.shape[2]]
        return self.codec.decode(keys, scale, self.compute_dtype), positions, extras, length

    def attend(self, layer: int, q: Tensor, valid: Tensor, span: int, scale: float) -> tuple[Tensor, Tensor]:
        """`decode_attention` over the quantized slots: q . (codes x scale) = (q . codes) x scale, and
        p . (codes x scale) = (p x scale) . codes, so only codes are read, never a dequantized copy of the whole
        span (which would read and write more memory than the dense cache holds). An int8 cache on the CPU is read
        one row and head at a time (`_int8_scores`, `_per_head_values`); any other all at once, CHUNK slots at a
        time (fp8's table lookups are slower per head)."""
        n, hq, _, d = q.shape
        hkv = self.k[layer].shape[1]
        qg = q.view(n, hkv, hq // hkv, d) * scale
        per_head = q.device.type == "cpu" and self.codec.name == "int8"
        if per_head:
            scores = self._int8_scores(layer, qg, span)
        else:
            scores = self._chunked_scores(qg, self.k[layer], span)
        scores *= self.k_scale[layer][:, :, None, :span].to(scores.dtype)
        probs = masked_probs(scores, valid)
        weights = (probs * self.v_scale[layer][:, :, None, :span]).to(qg.dtype)
        if per_head:
            out = self._per_head_values(layer, weights, span)
        else:
            out = self._chunked_values(weights, self.v[layer], span)
        return out.view(n, hq, 1, d), probs

    def _chunked_scores(self, q: Tensor, codes: Tensor, span: int) -> Tensor:
        """q [n, Hkv, G, d] . codes^T -> [n, Hkv, G, span], the codes converted CHUNK slots at a time for every row
        and head together."""
        out = q.new_empty(*q.shape[:3], span)
        for s in range(0, span, CHUNK):
            e = min(span, s + CHUNK)
            out[..., s:e] = torch.matmul(q, self.codec.codes(codes[:, :, s:e], q.dtype).transpose(-1, -2))
        return out

    def _chunked_values(self, weights: Tensor, codes: Tensor, span: int) -> Tensor:
        """weights [n, Hkv, G, span] . codes -> [n, Hkv, G, d], converted as `_chunked_scores`."""
        out = weights.new_zeros(*weights.shape[:3], codes.shape[-1])
        for s in range(0, span, CHUNK):
            e = min(span, s + CHUNK)
            out += torch.matmul(weights[..., s:e], self.codec.codes(codes[:, :, s:e], weights.dtype))
        return out

    def _int8_scores(self, layer: int, qg: Tensor, span: int) -> Tensor:
        """q . codes [n, Hkv, G, span] (the keys' scales not applied), one row and head at a time: the query
        quantized as the keys are (one absmax scale per query vector) and multiplied in int32 by torch's int8
        matmul: one layer's keys at 8k positions x 16 rows in 8 ms at one thread, against 15 ms for float32 keys
        and 55 ms to convert the codes alone (`python benchmarks/kv_quant.py conversion`); exact given the
        quantized query (integer sums; tested), whose rounding is part of the sampler's distribution, the one
        whose log-probs are recorded. (torch's CUDA int8 matmul needs at least 17 rows and multiples of 8: the
        GPU takes `_chunked_scores`.)"""
        k, (n, hkv, group, _) = self.k[layer], qg.shape
        out = qg.new_empty(n, hkv, group, span)
        q_codes, q_scale = self.codec.encode(qg)
        for row, head in itertools.product(range(n), range(hkv)):
            out[row, head] = torch._int_mm(k[row, head, :span], q_codes[row, head].t().contiguous()).t()
        return out.mul_(q_scale[..., None])

    def _per_head_values(self, layer: int, weights: Tensor, span: int) -> Tensor:
        """weights [n, Hkv, G, span] . codes [n, Hkv, G, d], one row and head at a time, its codes converted SLAB
        slots at a time (a slab's float copy stays in a core's cache; one product per slab, not per CHUNK)."""
        v = self.v[layer]
        out = weights.new_zeros(*weights.shape[:3], v.shape[-1])
        for row, head in itertools.product(range(v.shape[0]), range(v.shape[1])):
            acc = out[row, head]
            for s in range(0, span, SLAB):
                e = min(span, s + SLAB)
                acc.addmm_(weights[row, head, :, s:e], self.codec.codes(v[row, head, s:e], weights.dtype))
        return out

    def append(self, src: KVCache, rows: Tensor) -> None:
        """As `KVCache.append`; a full-precision source (a prefill) is quantized first."""
        super().append(src if isinstance(src, QuantizedKVCache) else self._encoded(src), rows)

    def _encoded(self, src: KVCache) -> QuantizedKVCache:
        """A quantized copy of a full-precision cache (every stored tensor but its keys and values shared)."""
        twin = copy.copy(self)
        twin._store = {n: t for n, t in src._store.items() if n[:2] not in ("k.", "v.")}
        for layer in range(src.num_layers):
            for part in ("k", "v"):
                data, scale = self.codec.encode(src._store[f"{part}.{layer}"])
                twin._store[f"{part}.{layer}"], twin._store[f"{part}s.{layer}"] = data, scale
        twin._rows, twin.capacity, twin.paged_state = src.rows, src.capacity, dict(src.paged_state)
        twin._views()
        return twin
