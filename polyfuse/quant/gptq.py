"""GPTQ (Frantar et al., 2023): load-time quantization that feeds each weight column's rounding error forward into the
columns not yet quantized, weighted by the inverse Hessian of the projection's inputs, which calibration text gives.

Round to nearest (quant_formats.quantize_components) rounds every weight on its own; GPTQ rounds the columns of a
projection one after the other and moves each column's error onto the later columns in the direction its inputs make
cheapest (H = sum of x x^T over the calibration tokens), so the projection's *output* error is smaller for the same
format. The result is the same layout as round to nearest (AutoGPTQ's int4 packing, int8 / fp8 per channel): the
kernels and checkpoints do not change, only which grid point each weight gets.

``record_hessians`` runs the float model over calibration token windows with its ``linear`` / ``swiglu_linear`` ops
wrapped, accumulating H per projection (keyed by its weight; the LM head is skipped; in q / k / v's H each window's
first tokens, the attention sinks, weigh more: ``sink_weighted``). ``gptq_components`` quantizes
one weight [N, K] with its H. The inputs are those of the float model, not AutoGPTQ's layer-by-layer pass through the
already-quantized layers (measured worse on the built-in model: docs/quantization.md); quantize_model_ records one
decoder layer's H at a time (``stop_early``: each forward stops after that layer), so one layer's H is held, not the
model's. Dampening: ``dampening`` (AutoGPTQ's 1% of H's mean diagonal, more for few
calibration tokens); columns no calibration token reached (a zero diagonal) are quantized as zeros. Blocks of 128 columns (int4: its group size, whose scale and zero are taken
from the updated weights when the group starts, as AutoGPTQ does without static groups).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from polyfuse.ops.quant_formats import FP8, FP8_MAX, fp8_row_scales, int4_group_params, int8_row_scales, pack_int4


GPTQ_FORMATS = ("int4", "int8", "fp8")
DAMP = 0.01
BLOCK = 128


# The first tokens of a window: the attention sinks (StreamingLLM keeps 4) that every later query of the window
# reads. In the H of a projection that makes keys and values each of them weighs the window's length / SINK_TOKENS
# (record_hessians ``sink_keys``).
SINK_TOKENS = 4


def sink_weighted(x: torch.Tensor) -> torch.Tensor:
    """A projection's inputs [..., L, K] as float32 rows [B * L, K], each window's first SINK_TOKENS rows scaled by
    sqrt(L / SINK_TOKENS), so that their x x^T weighs L / SINK_TOKENS in H. GPTQ puts rounding error into the input
    directions H says are rare; a sink's are (a few tokens per window) though every query reads its key and value.
    On the built-in model (int4, one 512-token window): unweighted +104% perplexity (round to nearest +63%), weighted
    +41.5% (docs/quantization.md, GPTQ)."""
    x3 = x.detach().float().reshape(-1, x.shape[-2], x.shape[-1])
    length = x3.shape[1]
    if length > SINK_TOKENS:
        x3 = x3.clone()
        x3[:, :SINK_TOKENS] *= math.sqrt(length / SINK_TOKENS)
    return x3.reshape(-1, x.shape[-1])


class _Recorded(Exception):
    """Raised inside a calibration forward once every projection asked for has seen its input (stop_early)."""


@torch.no_grad()
def record_hessians(model, windows: list[torch.Tensor], weights: dict, sink_keys=frozenset(), stop_early=False
                    ) -> dict:  # fmt: skip
    """{weight data_ptr: (H [K, K] float32 on the model's device, tokens)} for the projections whose weights
    ``weights`` maps (data_ptr -> anything), from a forward of the float ``model`` over each token window [L] (or
    [B, L]). In the projections of ``sink_keys`` (data_ptrs: q / k / v) each window's first tokens are weighted
    (``sink_weighted``). Every H asked for is held at once, K x K float32 each (all of Llama-3-8B's: about 33 GB; one
    layer's: about 1 GB). ``stop_early``: each window's forward ends (``_Recorded``, raised before the projection
    runs) once every projection asked for has seen its input; every rank of a tensor-parallel model stops at the
    same projection, before its collective."""
    found: dict = {}
    seen: set = set()  # this window's

    def add(x: torch.Tensor, weight: torch.Tensor) -> None:
        key = weight.data_ptr()
        if key not in weights:
            return
        tokens = x.numel() // x.shape[-1]
        x2 = sink_weighted(x) if key in sink_keys and x.dim() >= 2 else x.detach().reshape(-1, x.shape[-1]).float()
        h, n = found.get(key, (None, 0))
        h = x2.t() @ x2 if h is None else h.addmm_(x2.t(), x2)
        found[key] = (h, n + tokens)
        seen.add(key)
        if stop_early and len(seen) == len(weights):
            raise _Recorded

    kernels = model.kernels
    linear, swiglu_linear = kernels.linear, kernels.swiglu_linear

    def recording_linear(x, weight, bias=None):
        add(x, weight)
        return linear(x, weight, bias)

    def recording_swiglu_linear(gate, up, weight, bias=None):
        add(F.silu(gate.float()) * up.float(), weight)
        return swiglu_linear(gate, up, weight, bias)

    recording = copy.copy(kernels)  # the model's own resolution; only these two ops are wrapped
    recording.linear, recording.swiglu_linear = recording_linear, recording_swiglu_linear
    model.kernels = recording
    try:
        for ids in windows:
            ids = ids.to(model.device)
            seen.clear()
            try:
                model(ids[None] if ids.dim() == 1 else ids)
            except _Recorded:
                pass
    finally:
        model.kernels = kernels
    return found


# The token windows GPTQ records its Hessians on (run_generation.py's --quant_calibration, evaluate_perplexity.py's
# +gptq): 512 tokens each, at most 64 of them (32768 tokens).
CALIBRATION_WINDOW, CALIBRATION_WINDOWS = 512, 64


def calibration_windows(ids: torch.Tensor) -> list[torch.Tensor]:
    """1-D calibration token ids -> non-overlapping windows of CALIBRATION_WINDOW tokens (the last one shorter, none
    of one token), at most CALIBRATION_WINDOWS."""
    ids = ids[: CALIBRATION_WINDOW * CALIBRATION_WINDOWS]
    windows = (ids[i : i + CALIBRATION_WINDOW] for i in range(0, len(ids), CALIBRATION_WINDOW))
    return [w for w in windows if len(w) > 1]


def dampening(k: int, tokens: int) -> float:
    """The fraction of H's mean diagonal added to its diagonal: AutoGPTQ's 1% (DAMP) with its hundreds of thousands
    of calibration tokens; more when the tokens are few against the K inputs (K / (4 tokens), at most 1). H from a
    few hundred tokens is rank-deficient, and 1% let GPTQ fit the calibration tokens at the others' cost: on the
    built-in model with 679 calibration tokens, the down projection's output error on other text went from 0.099
    (round to nearest) to 0.126 at 1%, and to 0.093 at this rule's 0.57."""
    return max(DAMP, min(1.0, k / (4.0 * max(tokens, 1))))


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the upper Cholesky factor of the dampened H's inverse, float64; the dead inputs: zero diagonal, given a unit
    diagonal here and zero weight by the caller)."""
    h = h.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    idx = torch.arange(h.shape[0], device=h.device)
    h[idx, idx] += damp * torch.diagonal(h).mean()
    inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inv, upper=True), dead


class HessianFactor:
    """One projection's H [K, K] from ``tokens`` calibration inputs, factored on first use and kept: the parts of a
    fused projection (q / k / v, gate / up) share their input, so they share H and its factor (one Cholesky
    factorization and inverse per projection, not per part). The float32 H is dropped once factored."""

    def __init__(self, h: torch.Tensor, tokens: int = 0):
        self.h, self.tokens, self.k = h, tokens, h.shape[0]
        self.u = self.dead = None

    def get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.u is None:
            damp = dampening(self.k, self.tokens) if self.tokens else DAMP
            self.u, self.dead = _inverse_hessian_factor(self.h.to(device, torch.float64), damp)
            self.h = None
        return self.u.to(device), self.dead.to(device)


# Column rounders: col (float64 [N]) -> (its stored codes, the float64 values they stand for). Each rounding is decided
# in float32, as round to nearest (quant_formats) decides it, so with nothing fed forward the codes are the same.
def _int8_rounder(scale: torch.Tensor):
    def rnd(col):
        q = torch.clamp(torch.round(col.float() / scale), -127, 127)
        return q.to(torch.int8), q.double() * scale

    return rnd


def _fp8_rounder(scale: torch.Tensor):
    def rnd(col):
        q = (col.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, q.double() * scale

    return rnd


def _int4_rounder(scale16: torch.Tensor, zero: torch.Tensor):
    s = scale16.float()

    def rnd(col):
        q = torch.clamp(torch.round(col.float() / s) + zero, 0, 15)
        return q.to(torch.int32), s.double() * (q - zero).double()

    return rnd


CODE_DTYPES = {"int4": torch.int32, "int8": torch.int8, "fp8": FP8}


@torch.no_grad()
def gptq_components(fmt: str, w: torch.Tensor, group_size: int, h=None, tokens: int = 0
                    ) -> dict[str, torch.Tensor]:  # fmt: skip
    """``quantize_components``'s buffers for the float weight w [N, K] quantized by GPTQ with H [K, K], the sum of
    x x^T over ``tokens`` calibration inputs (0: many, AutoGPTQ's 1% dampening); ``h`` may be a HessianFactor that
    the parts of one fused projection share."""
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ quantizes {', '.join(GPTQ_FORMATS)}, not {fmt!r}")
    home = w.device
    # the column loop is many small float64 ops: on a CUDA GPU where the weights are there, else on the CPU (Gaudi has
    # no float64)
    w = w.detach().to("cpu" if home.type != "cuda" else home, torch.float64, copy=True)
    n, k = w.shape
    factor = h if isinstance(h, HessianFactor) else HessianFactor(h, tokens)
    u, dead = factor.get(w.device)
    w[:, dead] = 0.0
    codes = torch.empty(n, k, dtype=CODE_DTYPES[fmt], device=w.device)
    if fmt == "int4":
        g = min(group_size, k)
        scales = torch.empty(math.ceil(k / g), n, dtype=torch.float16, device=w.device)
        zeros = torch.empty(math.ceil(k / g), n, dtype=torch.int32, device=w.device)
    else:  # per channel: the scales of the original rows (int8 with its clipping search), as round to nearest's
        g = k
        scale = int8_row_scales(w.float()) if fmt == "int8" else fp8_row_scales(w.float())
        rnd = _int8_rounder(scale) if fmt == "int8" else _fp8_rounder(scale)
    block = g if g < k else BLOCK  # int4 groups start at block starts
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb = w[:, b0:b1].clone()
        errs = torch.zeros_like(wb)
        ub = u[b0:b1, b0:b1]
        if fmt == "int4" and b0 % g == 0:  # the group's scale and zero from its weights as updated so far
            s16, z = int4_group_params(w[:, b0 : min(b0 + g, k)].float()[:, None, :])
            scales[b0 // g], zeros[b0 // g] = s16[:, 0], z[:, 0].to(torch.int32)
            rnd = _int4_rounder(s16[:, 0], z[:, 0])
        for i in range(b1 - b0):
            col = wb[:, i]
            codes[:, b0 + i], qcol = rnd(col)
            err = (col - qcol) / ub[i, i]
            wb[:, i:] -= err[:, None] * ub[i, i:][None, :]
            errs[:, i] = err
        w[:, b1:] -= errs @ u[b0:b1, b1:]
    if fmt == "int4":
        qweight, qzeros = pack_int4(codes.t(), zeros)
        g_idx = torch.arange(k, dtype=torch.int32, device=w.device) // g
        parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    else:
        parts = {"qweight": codes, "scales": scale}
    return {name: t.to(home) for name, t in parts.items()}
