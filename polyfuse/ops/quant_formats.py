"""Quantized weight formats: the data the ``linear_q`` / ``swiglu_linear_q`` ops take (polyfuse/ops/quant_linear.py).

A :class:`QuantizedWeight` is one projection's weight [N out, K in] in a packed form, with the scales (and zeros)
that turn it back into numbers. Every format is row-local: output row ``n`` depends only on its own packed data and
scales, so the load-time fusions (q/k/v, gate/up) concatenate parts along N and saving splits them back.

=============  =========================================================================================================
format         components (module buffer: dtype [shape]) and value of weight [n, k]
=============  =========================================================================================================
``int8``       qweight: int8 [N, K]; scales: float32 [N].  w = qweight[n, k] * scales[n]  (symmetric, per channel)
``int4``       AutoGPTQ's layout (``checkpoint_format: gptq``), asymmetric, groups of ``group_size`` (128) along K:
               qweight: int32 [K/8, N], weight k of word [k // 8, n] in bits 4 (k % 8) .. 4 (k % 8) + 3;
               qzeros: int32 [G, N/8], zero of column n in bits 4 (n % 8).. of word [g, n // 8], stored minus one
               (AutoGPTQ's convention); scales: float16 [G, N]; g_idx: int32 [K], the group of each k (k // group_size,
               or a permutation's groups for act-order checkpoints). G = ceil(K / group_size): a last partial group
               is allowed, as in AutoGPTQ's layout.  w = (q[k, n] - (qzeros[g, n] + 1)) * scales[g, n], g = g_idx[k]
``fp8``        qweight: float8_e4m3fn [N, K]; scales: float32 [N].  w = qweight[n, k] * scales[n]  (per channel)
``fp8_block``  qweight: float8_e4m3fn [N, K]; scales: float32 [N, ceil(K / 128)]: one scale per 128 consecutive
               weights of a row (1 x 128 blocks; compressed-tensors' "group" strategy). A checkpoint's 128 x 128 block
               scales load into it exactly (each block scale repeated over its 128 rows).
``gguf_q8_0``  qweight: uint8 [N, K / 32 * 34]: llama.cpp's blocks of 32, kept as the file has them: fp16 d, 32 int8.
``gguf_q4_0``  qweight: uint8 [N, K / 32 * 18]: fp16 d, 16 bytes of nibbles (byte j: weight j low, j + 16 high);
               w = d * (q - 8)
``gguf_q4_1``  qweight: uint8 [N, K / 32 * 20]: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
``gguf_q4_k``  qweight: uint8 [N, K / 256 * 144]: llama.cpp's super-blocks of 256 (8 sub-blocks of 32): fp16 d,
               fp16 dmin, 12 bytes of 6-bit scales sc and mins m per sub-block, 128 bytes of nibbles (byte 32 j + l:
               weight 64 j + l low, 64 j + 32 + l high); w = (d * sc) * q - (dmin * m)
``gguf_q5_k``  qweight: uint8 [N, K / 256 * 176]: as Q4_K with a fifth bit per weight: fp16 d, fp16 dmin, the 12 scale
               bytes, 32 bytes qh (bit s of byte l: weight 32 s + l's), 128 bytes of low nibbles laid out as Q4_K's;
               w = (d * sc) * q - (dmin * m), q = 0..31
``gguf_q6_k``  qweight: uint8 [N, K / 256 * 210]: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8
               scales (one per 16 weights), fp16 d last; w = (d * sc) * (q - 32)
=============  =========================================================================================================

``dequantize`` (any device, torch only) is the reference every kernel is tested against; ``quantize`` makes the
formats from a float weight (round to nearest; the 32-weight GGUF types through the ``gguf`` package, the K-quants by
``_quantize_k``; GGUF formats for tests and benchmarks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
INT4_GROUP = 128
GGUF_BLOCK = 32
GGUF_SUPER = 256  # the K-quants' super-block
# GGUF kept types: bytes per block, weights per block, and the ggml type name.
GGUF_BYTES = {"gguf_q8_0": 34, "gguf_q4_0": 18, "gguf_q4_1": 20, "gguf_q4_k": 144, "gguf_q5_k": 176, "gguf_q6_k": 210}
K_QUANTS = ("gguf_q4_k", "gguf_q5_k", "gguf_q6_k")
GGUF_WEIGHTS = {"gguf_q8_0": 32, "gguf_q4_0": 32, "gguf_q4_1": 32, **dict.fromkeys(K_QUANTS, GGUF_SUPER)}
GGUF_TYPES = {"Q8_0": "gguf_q8_0", "Q4_0": "gguf_q4_0", "Q4_1": "gguf_q4_1", "Q4_K": "gguf_q4_k", "Q5_K": "gguf_q5_k",
              "Q6_K": "gguf_q6_k"}  # fmt: skip

DESCRIPTIONS = {
    "int8": "int8 weight-only, per-channel scales",
    "int4": "int4 weight-only, AutoGPTQ layout, asymmetric, group {group}",
    "fp8": "fp8 e4m3 weights, per-channel scales",
    "fp8_block": "fp8 e4m3 weights, one scale per 1x128 block",
    "gguf_q8_0": "GGUF Q8_0 blocks as stored (32 int8 + fp16 scale)",
    "gguf_q4_0": "GGUF Q4_0 blocks as stored (32 x 4 bit + fp16 scale)",
    "gguf_q4_1": "GGUF Q4_1 blocks as stored (32 x 4 bit + fp16 scale and min)",
    "gguf_q4_k": "GGUF Q4_K super-blocks as stored (256 x 4 bit, 6-bit scales and mins per 32)",
    "gguf_q5_k": "GGUF Q5_K super-blocks as stored (256 x 5 bit, 6-bit scales and mins per 32)",
    "gguf_q6_k": "GGUF Q6_K super-blocks as stored (256 x 6 bit, int8 scales per 16)",
}
FORMATS = tuple(DESCRIPTIONS)
# Formats ``quantize`` makes from a float checkpoint at load time (``--quant``).
LOAD_TIME_FORMATS = ("int8", "int4", "fp8", "fp8_block")


@dataclass(frozen=True)
class Component:
    shape: tuple
    dtype: torch.dtype
    n_dim: Optional[int]  # the dim indexing output rows (None: shared by all rows, e.g. g_idx)
    n_per: int = 1  # output rows per index along n_dim (8 for int4's packed zeros)
    # The dim indexing input columns (None: none, e.g. a per-channel scale): ``k_span`` indices per ``k_per``
    # columns (int4's words: 1 per 8; its scales: 1 per group; a GGUF block: 34, 18 or 20 bytes per 32, a K-quant's
    # 144 or 210 per 256). Tensor
    # parallelism slices a row-parallel projection's components along it (quant/shards.py).
    k_dim: Optional[int] = None
    k_per: int = 1
    k_span: int = 1


@dataclass(frozen=True)
class QuantizedWeight:
    """One projection's packed weight, as the ``linear_q`` ops take it. Tensors are the owning module's buffers."""

    format: str
    shape: tuple  # (N, K): out_features, in_features
    qweight: torch.Tensor
    scales: Optional[torch.Tensor] = None
    qzeros: Optional[torch.Tensor] = None
    g_idx: Optional[torch.Tensor] = None
    group_size: int = 0  # int4: weights per group along K; fp8_block: 128
    act_order: bool = False  # int4: g_idx is not k // group_size (an act-order GPTQ checkpoint)

    @property
    def device(self) -> torch.device:
        return self.qweight.device


def describe(fmt: str, group_size: int = INT4_GROUP) -> str:
    return DESCRIPTIONS[fmt].format(group=group_size)


def components(fmt: str, n: int, k: int, group_size: int = INT4_GROUP) -> dict[str, Component]:
    """The buffers of ``fmt`` for a [n, k] weight (shapes for a model's meta-built modules and for checks)."""
    if fmt in ("int8", "fp8"):
        return {"qweight": Component((n, k), torch.int8 if fmt == "int8" else FP8, 0, k_dim=1),
                "scales": Component((n,), torch.float32, 0)}  # fmt: skip
    if fmt == "fp8_block":
        return {
            "qweight": Component((n, k), FP8, 0, k_dim=1),
            "scales": Component((n, math.ceil(k / FP8_BLOCK)), torch.float32, 0, k_dim=1, k_per=FP8_BLOCK),
        }
    if fmt == "int4":
        g = math.ceil(k / group_size)
        return {
            "qweight": Component((k // 8, n), torch.int32, 1, k_dim=0, k_per=8),
            "qzeros": Component((g, n // 8), torch.int32, 1, 8, k_dim=0, k_per=group_size),
            "scales": Component((g, n), torch.float16, 1, k_dim=0, k_per=group_size),
            "g_idx": Component((k,), torch.int32, None, k_dim=0),
        }
    if fmt in GGUF_BYTES:
        b, per = GGUF_BYTES[fmt], GGUF_WEIGHTS[fmt]
        return {"qweight": Component((n, k // per * b), torch.uint8, 0, k_dim=1, k_per=per, k_span=b)}
    raise ValueError(f"unknown quantized format {fmt!r} (known: {', '.join(FORMATS)})")


def cannot_pack(fmt: str, k: int, row_parts: tuple) -> Optional[str]:
    """Why ``fmt`` cannot hold a [sum(row_parts), k] weight whose rows are the fused parts ``row_parts``, or None."""
    if fmt == "int4":
        if k % 8 or any(p % 8 for p in row_parts):
            return "int4 packs 8 weights per int32: in_features and every fused part's out_features must be multiples of 8"
    elif fmt in GGUF_BYTES:
        if k % GGUF_WEIGHTS[fmt]:
            per = GGUF_WEIGHTS[fmt]
            return f"GGUF {fmt[5:].upper()} blocks hold {per} weights: in_features must be a multiple of {per}"
    elif fmt not in DESCRIPTIONS:
        return f"unknown quantized format {fmt!r}"
    return None


# ---- dequantization: the reference ------------------------------------------------------------------------------


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> int32 [..., M * 8]: nibble i of word m at position 8 m + i (low bits first)."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 15).flatten(-2)


def unpack_int4(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [K, N], zeros [G, N]) as int32 from AutoGPTQ's qweight / qzeros (zeros with the stored minus one undone)."""
    q = _unpack_nibbles(qw.qweight.t()).t()  # [K/8, N] -> [N, K] -> [K, N]
    zeros = _unpack_nibbles(qw.qzeros) + 1
    return q, zeros


def _in_group_order(qw: QuantizedWeight) -> bool:
    """g_idx is k // group_size, for a weight on the CPU (read from g_idx itself: a weight dequantized while a
    checkpoint loads has no act_order flag set yet). On a device that would be a host sync per call (and an error
    inside a CUDA or HPU graph's capture), so there the per-weight gather stays."""
    gs, k = qw.group_size, qw.shape[1]
    if qw.g_idx is None or qw.g_idx.device.type != "cpu":
        return False
    if gs <= 0 or qw.g_idx.numel() != k or qw.scales.shape[0] != -(-k // gs):
        return False
    order = torch.arange(k, device=qw.g_idx.device, dtype=qw.g_idx.dtype) // gs
    return torch.equal(qw.g_idx, order)


def _int4_in_order(qw: QuantizedWeight) -> torch.Tensor:
    """float32 [N, K] (a transposed view) of int4 in group order (g_idx = k // group_size): the nibbles unpacked as
    bytes along K and each group's zero and scale broadcast over its rows, with no per-weight gather; the same
    values, bit for bit, as the act-order path's (q - zero) * scale (the difference is an exact small integer either
    way). On the CPU about 10x faster than the gather (the built-in model's int4 decode: 655 -> 166 ms per token)."""
    n, k = qw.shape
    k8 = qw.qweight.shape[0]
    b = qw.qweight.contiguous().view(torch.uint8).view(k8, n, 4)  # little-endian: nibbles 2 j (low), 2 j + 1 (high)
    q = torch.stack((b & 15, b >> 4), dim=-1).permute(0, 2, 3, 1).reshape(k8 * 8, n)  # row 8 m + 2 j + h
    gs = qw.group_size
    g = qw.scales.shape[0]
    if g * gs > q.shape[0]:  # a last partial group: rows of zero codes, cut off below
        q = torch.nn.functional.pad(q, (0, 0, 0, g * gs - q.shape[0]))
    zeros = (_unpack_nibbles(qw.qzeros) + 1).float()[:, None, :]
    w = q[: g * gs].view(g, gs, n).float().sub_(zeros).mul_(qw.scales.float()[:, None, :])
    return w.view(g * gs, n)[:k].t()


def _fp16_at(raw: torch.Tensor, byte: int) -> torch.Tensor:
    """float32 [N, blocks] from the fp16 at ``byte`` of every GGUF block of raw [N, blocks, bytes]."""
    return raw[..., byte : byte + 2].contiguous().view(torch.float16)[..., 0].float()


def q4_k_scales(sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sc, m) int32 [..., 8] of Q4_K's 12 scale bytes [..., 12]: sub-block j < 4 in the low 6 bits of bytes j (scale)
    and j + 4 (min); j >= 4 in the nibbles of byte j + 4 with 2 high bits from the top of bytes j - 4 / j."""
    s = sb.to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    m = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, m


def _k_quant_dequantize(fmt: str, raw: torch.Tensor) -> torch.Tensor:
    """float32 [N, blocks, 256] of K-quant super-blocks raw [N, blocks, bytes], in the reference's (llama.cpp's and
    the gguf package's) order of operations: (d * sc) * q, minus dmin * m for Q4_K / Q5_K."""
    if fmt in ("gguf_q4_k", "gguf_q5_k"):
        d, dmin = _fp16_at(raw, 0)[..., None], _fp16_at(raw, 2)[..., None]
        sc, m = q4_k_scales(raw[..., 4:16])
        five = fmt == "gguf_q5_k"
        qs = raw[..., 48 if five else 16 :].reshape(*raw.shape[:2], 4, 32).to(torch.int32)
        q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(*raw.shape[:2], 8, 32)  # sub-block 2j: low nibbles
        if five:  # bit s of qh byte l: the fifth bit of sub-block s's weight l
            qh = raw[..., 16:48].to(torch.int32)[..., None, :]
            q = q | (((qh >> torch.arange(8, dtype=torch.int32, device=raw.device)[:, None]) & 1) << 4)
        q = q.float()
        return ((d * sc.float())[..., None] * q - (dmin * m.float())[..., None]).flatten(-2)
    ql = raw[..., 0:128].reshape(*raw.shape[:2], 2, 1, 64).to(torch.int32)
    qh = raw[..., 128:192].reshape(*raw.shape[:2], 2, 1, 32).to(torch.int32)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(*raw.shape[:2], 2, 4, 32)  # weight 128 h + 32 s + l
    high = (qh >> torch.arange(0, 8, 2, dtype=torch.int32, device=raw.device)[:, None]) & 3  # no host copy: graphs
    q = (low | (high << 4)).reshape(*raw.shape[:2], 16, 16).float() - 32.0
    sc = raw[..., 192:208].contiguous().view(torch.int8).float()
    d = _fp16_at(raw, 208)[..., None]
    return ((d * sc)[..., None] * q).flatten(-2)


def _gguf_dequantize(fmt: str, data: torch.Tensor, k: int) -> torch.Tensor:
    n = data.shape[0]
    if fmt in K_QUANTS:
        raw = data.reshape(n, k // GGUF_SUPER, GGUF_BYTES[fmt])
        return _k_quant_dequantize(fmt, raw).reshape(n, k)
    raw = data.view(n, k // GGUF_BLOCK, GGUF_BYTES[fmt])
    d = _fp16_at(raw, 0)[..., None]
    if fmt == "gguf_q8_0":
        q = raw[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, k)
    qs = raw[..., 4:] if fmt == "gguf_q4_1" else raw[..., 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()  # byte j: weight j (low nibble), weight j + 16 (high)
    if fmt == "gguf_q4_0":
        return ((q - 8.0) * d).reshape(n, k)
    return (q * d + _fp16_at(raw, 2)[..., None]).reshape(n, k)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight in ``dtype``: computed in float32, rounded once."""
    n, k = qw.shape
    fmt = qw.format
    if fmt in ("int8", "fp8"):
        w = qw.qweight.float() * qw.scales.float()[:, None]
    elif fmt == "fp8_block":
        w = qw.qweight.float() * qw.scales.repeat_interleave(FP8_BLOCK, dim=1)[:, :k]
    elif fmt == "int4" and _in_group_order(qw):
        w = _int4_in_order(qw)
    elif fmt == "int4":  # act order, or off the CPU: each weight's group gathered
        q, zeros = unpack_int4(qw)
        g = qw.g_idx.long()
        w = ((q - zeros[g]).float() * qw.scales.float()[g]).t()
    elif fmt in GGUF_BYTES:
        w = _gguf_dequantize(fmt, qw.qweight, k)
    else:
        raise ValueError(f"unknown quantized format {fmt!r}")
    return w.to(dtype)


# ---- quantization (load time: --quant; tests) ---------------------------------------------------------------------


def pack_int4(q: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's packing: q [K, N] (0..15) -> qweight int32 [K/8, N]; zeros [G, N] (1..16) -> qzeros int32 [G, N/8]
    holding zeros minus one."""

    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)

    def pack(t: torch.Tensor) -> torch.Tensor:  # [..., M] -> int32 [..., M/8], element 8 m + i at bits 4 i
        words = (t.to(torch.int64).reshape(*t.shape[:-1], -1, 8) << shifts).sum(-1)  # disjoint bits: sum == or
        return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # as int32 bit patterns

    return pack(q.t()).t().contiguous(), pack((zeros - 1) & 15).contiguous()


def int4_group_params(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float16 scales, float zeros in 1..15) of float32 weight groups [N, G, size]: the range always holds 0 (GPTQ's
    convention), q = round(w / scale) + zero."""
    wmin = groups.amin(-1).clamp(max=0.0)
    wmax = groups.amax(-1).clamp(min=0.0)
    scale = (wmax - wmin) / 15.0
    empty = scale == 0
    scale = torch.where(empty, torch.ones_like(scale), scale)
    zero = torch.round(-wmin / scale)
    # AutoGPTQ stores zero - 1 in 4 bits: a zero of 0 cannot be stored. Such a group (all weights >= 0) gets zero 1
    # and a scale that maps its maximum to 15.
    low = zero < 1
    scale = torch.where(low & ~empty, wmax / 14.0, scale)
    zero = torch.where(low, torch.ones_like(zero), zero).clamp(max=15)
    return scale.half(), zero


def _quantize_int4(w: torch.Tensor, group_size: int) -> dict:
    """Round-to-nearest asymmetric int4 per group of ``group_size`` along K, the range always holding 0 (GPTQ's
    convention); a last partial group is quantized over its own weights."""
    n, k = w.shape
    g = math.ceil(k / group_size)
    padded = torch.nn.functional.pad(w, (0, g * group_size - k))  # zeros: inside every range anyway
    groups = padded.view(n, g, group_size)
    scale16, zero = int4_group_params(groups)
    q = torch.clamp(torch.round(groups / scale16.float()[..., None]) + zero[..., None], 0, 15)
    q = q.view(n, g * group_size)[:, :k].to(torch.int32)
    qweight, qzeros = pack_int4(q.t(), zero.t().to(torch.int32))
    g_idx = torch.arange(k, dtype=torch.int32, device=w.device) // group_size
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale16.t().contiguous(), "g_idx": g_idx}


# Fractions of a row's largest magnitude tried as the int8 clipping range (the one with the least squared error wins).
INT8_CLIPS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.9, 0.88, 0.85, 0.82, 0.8)


def _quantize_int8(w: torch.Tensor) -> dict:
    """Symmetric int8 per output channel, round to nearest, with ``int8_row_scales``."""
    scale = int8_row_scales(w)
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return {"qweight": q, "scales": scale}


def int8_row_scales(w: torch.Tensor) -> torch.Tensor:
    """Each row's int8 scale: the clipping of its largest magnitude (INT8_CLIPS) with the least squared
    round-to-nearest error (a few outliers rounded coarsely, the rest finer)."""
    amax = w.abs().amax(-1)
    best_err = torch.full_like(amax, float("inf"))
    best_scale = amax.clone()
    t = torch.empty_like(w)
    for c in INT8_CLIPS:
        scale = (amax * c / 127.0).clamp(min=1e-12)[:, None]
        torch.div(w, scale, out=t)
        err = t.round_().clamp_(-127, 127).mul_(scale).sub_(w).square_().sum(-1)
        better = err < best_err  # ties keep the larger range
        best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale[:, 0], best_scale)
    return best_scale


def fp8_row_scales(w: torch.Tensor, fp8_max: float = FP8_MAX) -> torch.Tensor:
    """Each row's e4m3 scale: its largest magnitude maps to ``fp8_max`` (448; 240 for weights made on a Gaudi2)."""
    return (w.abs().amax(-1) / fp8_max).clamp(min=1e-12)


# Rows quantized at a time (about this many weights): on the CPU a chunk's temporaries stay in cache (int8's clipping
# search makes ten passes over them); on a GPU one chunk is a whole projection of an 8B model.
CHUNK_WEIGHTS = {"cpu": 1 << 18}
DEFAULT_CHUNK_WEIGHTS = 1 << 28


def quantize_components(
    fmt: str, w: torch.Tensor, group_size: int = INT4_GROUP, fp8_max: float = FP8_MAX
) -> dict[str, torch.Tensor]:
    """{buffer name: tensor} of ``fmt`` for the float weight w [N, K] (round to nearest), a chunk of rows at a time
    (every format is row-local; chunks of a multiple of 8 rows keep int4's packed zeros whole). fp8 scales each row
    (block) so that its largest magnitude is ``fp8_max``: 448, or the device's smaller range (Gaudi2: 240)."""
    n, k = w.shape
    rows = max(8, CHUNK_WEIGHTS.get(w.device.type, DEFAULT_CHUNK_WEIGHTS) // max(k, 1) // 8 * 8)
    if fmt in GGUF_BYTES or n <= rows:
        return _quantize_rows(fmt, w.float(), group_size, fp8_max)
    chunks = [_quantize_rows(fmt, w[r : r + rows].float(), group_size, fp8_max) for r in range(0, n, rows)]
    out = {}
    for name, c in components(fmt, n, k, group_size).items():
        parts = [ch[name] for ch in chunks]
        out[name] = parts[0] if c.n_dim is None else torch.cat(parts, dim=c.n_dim)
    return out


def _quantize_rows(fmt: str, w: torch.Tensor, group_size: int, fp8_max: float = FP8_MAX) -> dict[str, torch.Tensor]:
    n, k = w.shape
    if fmt == "int8":
        return _quantize_int8(w)
    if fmt == "fp8":
        scale = fp8_row_scales(w, fp8_max)
        return {"qweight": (w / scale[:, None]).clamp(-fp8_max, fp8_max).to(FP8), "scales": scale}
    if fmt == "fp8_block":
        nb = math.ceil(k / FP8_BLOCK)
        blocks = torch.nn.functional.pad(w, (0, nb * FP8_BLOCK - k)).view(n, nb, FP8_BLOCK)
        scale = (blocks.abs().amax(-1) / fp8_max).clamp(min=1e-12)
        q = (blocks / scale[..., None]).clamp(-fp8_max, fp8_max).view(n, -1)[:, :k].to(FP8)
        return {"qweight": q.contiguous(), "scales": scale}
    if fmt == "int4":
        return _quantize_int4(w, group_size)
    if fmt in K_QUANTS:
        return {"qweight": _quantize_k(fmt, w)}
    if fmt in GGUF_BYTES:
        return {"qweight": _quantize_32(fmt, w)}
    raise ValueError(f"unknown quantized format {fmt!r}")


def _fp16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.half().contiguous().view(torch.uint8).reshape(*t.shape, 2)


def _quantize_32(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 32 * bytes]: Q8_0 / Q4_0 / Q4_1 blocks of w as llama.cpp's reference quantizer writes them in
    float32 without fused multiply-adds (the gguf package's numpy quantizer: equal bytes, tested on the CPU), in torch
    arithmetic on w's device (no copy to the host). Every division is by a tensor: CUDA divides a tensor by a Python
    number as a multiply by its reciprocal, which rounds differently. A block whose scale d is so small that 1 / d
    overflows (d below float32's normal range: the block's largest |w| under ~3.7e-37 for Q8_0, ~2.4e-38 for Q4_0)
    gets quants 0, as llama.cpp's conversion of inf gives on x86 (C leaves it undefined) and the gguf package writes;
    its fp16 d is 0, so any quant dequantizes to the same value. Signed zeros as ggml's C loops leave them (the gguf
    package may differ there: other bytes, the same values): Q4_1's m and max are the first of equal minima / maxima
    (its strict < and >), and an all-zero Q4_0 block has d = +0 / -8 = -0."""
    n, k = w.shape
    v = w.float().reshape(n, k // GGUF_BLOCK, GGUF_BLOCK)

    def inverse(d):  # (1 / d, 0 where d is 0 or 1 / d overflows; where it overflows)
        one = torch.ones_like(d)
        inv = one / torch.where(d == 0, one, d)
        over = inv.isinf()
        return torch.where((d == 0) | over, torch.zeros_like(d), inv), over

    def divide(x, by):
        return x / torch.full_like(x, by)

    if fmt == "gguf_q8_0":
        d = divide(v.abs().amax(-1, keepdim=True), 127.0)
        inv, over = inverse(d)
        x = v * inv
        a = x.abs()  # rounded half away from zero, as ggml's roundf
        q = torch.where(over, 0.0, torch.sign(x) * (torch.floor(a) + torch.floor(2 * (a - torch.floor(a)))))
        parts = [_fp16_bytes(d[..., 0]), q.to(torch.int8).view(torch.uint8)]
    else:
        if fmt == "gguf_q4_0":  # the value of largest magnitude (the first of equals; +0 in a zero block) is -8 d
            big = torch.gather(v, -1, v.abs().argmax(-1, keepdim=True))
            d = divide(torch.where(big == 0, torch.zeros_like(big), big), -8.0)
            inv, over = inverse(d)
            q = torch.trunc(v * inv + 8.5)
            head = [_fp16_bytes(d[..., 0])]
        else:
            lo = torch.gather(v, -1, v.argmin(-1, keepdim=True))
            d = divide(torch.gather(v, -1, v.argmax(-1, keepdim=True)) - lo, 15.0)
            inv, over = inverse(d)
            q = torch.trunc((v - lo) * inv + 0.5)
            head = [_fp16_bytes(d[..., 0]), _fp16_bytes(lo[..., 0])]
        q = torch.where(over, 0.0, q).clamp(0, 15).to(torch.uint8)  # overflow: Q4_0's 8.5 would give 8
        parts = [*head, q[..., :16] | (q[..., 16:] << 4)]
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def _quantize_k(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 256 * bytes]: K-quant super-blocks of w by plain round to nearest (tests and benchmarks; llama.cpp's
    own quantizer searches its scales, which this does not), in the layout its files have."""
    n, k = w.shape
    blocks = w.reshape(n, k // GGUF_SUPER, GGUF_SUPER)
    if fmt in ("gguf_q4_k", "gguf_q5_k"):
        top = 31 if fmt == "gguf_q5_k" else 15
        sub = blocks.reshape(*blocks.shape[:2], 8, 32)
        lo, hi = sub.amin(-1).clamp(max=0.0), sub.amax(-1).clamp(min=0.0)
        scale, mins = (hi - lo) / top, -lo
        d = (scale.amax(-1) / 63.0).half().float().clamp(min=2**-24)  # fp16 as stored (2^-24: its smallest step)
        dmin = (mins.amax(-1) / 63.0).half().float().clamp(min=2**-24)
        sc = torch.round(scale / d[..., None]).clamp(0, 63)
        m = torch.round(mins / dmin[..., None]).clamp(0, 63)
        step = (d[..., None] * sc).clamp(min=1e-30)
        q = torch.round((sub + (dmin[..., None] * m)[..., None]) / step[..., None]).clamp(0, top).to(torch.int32)
        sc, m = sc.to(torch.int32), m.to(torch.int32)
        packed = torch.cat([
            (sc[..., :4] | ((sc[..., 4:] >> 4) << 6)), (m[..., :4] | ((m[..., 4:] >> 4) << 6)),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ], dim=-1).to(torch.uint8)  # fmt: skip
        pairs = q.reshape(*q.shape[:2], 4, 2, 32) & 15
        qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).to(torch.uint8).flatten(-2)
        qh = []
        if top == 31:  # bit s of byte l: sub-block s's weight l's fifth bit
            bits = (q >> 4) << torch.arange(8, dtype=torch.int32, device=w.device)[:, None]
            qh = [bits.sum(-2).to(torch.uint8)]
        raw = torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), packed, *qh, qs], dim=-1)
    else:
        sub = blocks.reshape(*blocks.shape[:2], 16, 16)
        scale = sub.abs().amax(-1) / 31.0
        d = (scale.amax(-1) / 127.0).half().float().clamp(min=2**-24)
        sc = torch.round(scale / d[..., None]).clamp(-128, 127)
        step = (d[..., None] * sc).clamp(min=1e-30)
        q = (torch.round(sub / step[..., None]).clamp(-32, 31) + 32).to(torch.int32)  # weight 16 i + j
        q = q.reshape(*q.shape[:2], 2, 4, 32)  # [half, s, l]: weight 128 h + 32 s + l
        ql = ((q[..., 0:2, :] & 15) | ((q[..., 2:4, :] & 15) << 4)).flatten(-3)  # byte 64 h + 32 s + l
        top = q >> 4  # weight 128 h + 32 s + l: its 2 high bits at bits 2 s of qh byte 32 h + l
        qh = (top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)).flatten(-2)
        sc8 = sc.to(torch.int8).view(torch.uint8)
        raw = torch.cat([ql.to(torch.uint8), qh.to(torch.uint8), sc8,
                         _fp16_bytes(d)], dim=-1)  # fmt: skip
    return raw.reshape(n, -1).contiguous()


def quantize(fmt: str, w: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """A standalone QuantizedWeight of the float weight w [N, K] (tests, benchmarks)."""
    if fmt == "fp8_block":
        group_size = FP8_BLOCK
    parts = quantize_components(fmt, w, group_size)
    return QuantizedWeight(fmt, tuple(w.shape), group_size=group_size if fmt in ("int4", "fp8_block") else 0, **parts)
