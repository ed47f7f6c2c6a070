"""Registers the portable Triton kernels (the ``triton`` entry point). Importing this module imports no kernel and
not triton: probes import triton once (cached), each kernel module is imported on its first call. Implementations
registered with ``options=True`` get the run's KernelOptions (core/kernel_options.py): PDL, W4A8, tile tables."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

import polyfuse.ops  # noqa: F401  (declares the ops before we register against them)
from polyfuse.core.context import SelectionContext
from polyfuse.core.plugins import lazy_function
from polyfuse.core.registry import Implementation
from polyfuse.core.registry import register as register_impl


BACKEND = "triton"
DEVICES = ("cuda",)
PLATFORMS = ("cuda", "rocm")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PRIORITY = 100


@functools.lru_cache(maxsize=None)
def triton_unusable() -> Optional[str]:
    """None when triton imports, else why not (cached: probes run once per op per model build)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"triton not importable ({type(e).__name__}: {e})"[:160]
    return None


def probe_triton(ctx: SelectionContext) -> Optional[str]:
    if ctx.dtype not in DTYPES:
        return f"dtype {str(ctx.dtype).replace('torch.', '')} unsupported"
    return triton_unusable()


def probe_inference(ctx: SelectionContext) -> Optional[str]:
    return "inference only" if ctx.training else probe_triton(ctx)


def probe_training_fold(ctx: SelectionContext) -> Optional[str]:
    """swiglu_linear's training implementation that recomputes silu(gate) * up: training only, opt-in
    (``swiglu_linear=triton_recompute``), and not where the run forced SwiGLU native (the composite, which calls the
    run's own swiglu choice, honours that). Opt-in because it trades speed for memory: on the H200 (Llama-3.2-1B
    shape, 8 x 2048 tokens, checkpointing) 56.0k tok/s at 10.45 GiB against the composite's 59.0k at 10.67 GiB."""
    from polyfuse.core.registry import run_overrides

    if not ctx.training:
        return "training only (inference: the GEMV or the composite)"
    overrides = run_overrides(ctx)
    if overrides.get("swiglu_linear") != "triton_recompute":
        return "opt-in (swiglu_linear=triton_recompute: 0.2 GiB less, 5% slower at the 1B shape)"
    if overrides.get("swiglu") == "-":
        return "swiglu forced native (-swiglu): the composite runs"
    return probe_triton(ctx)


def probe_gemv(ctx: SelectionContext) -> Optional[str]:
    """The one-row bf16 GEMV of ``linear`` / ``swiglu_linear``: inference, and a table tuned for this GPU."""
    why = probe_inference(ctx)
    if why is not None:
        return why
    from polyfuse.backends.triton.gemv import table_for

    if not table_for(ctx.platform.device_name, ctx.options.tile_configs):
        return f"no GEMV table tuned for {ctx.platform.device_name or 'this GPU'}"
    return None


def _impl(op, name, module, attr, probe=probe_triton, priority=PRIORITY, backward=True, accepts=False, quiet=False,
          options=True):  # fmt: skip  # size: one keyword per Implementation field it fills
    """A Triton implementation: ``options``: its functions take the run's KernelOptions (PDL, tiles)."""
    mod = f"polyfuse.backends.triton.{module}"
    return Implementation(
        op, name, BACKEND, DEVICES, lazy_function(mod, attr), priority, probe, supports_backward=backward,
        platforms=PLATFORMS, accepts=lazy_function(mod, accepts) if accepts else None, quiet_decline=quiet,
        options=options,
    )  # fmt: skip


GEMV_NOTE = "Triton GEMV on the one-row shapes tuned for this GPU (configs/gemv), the next choice otherwise"


def _gemv(op: str) -> Implementation:
    """The tuned one-row GEMV: its tables are NVIDIA products' (a ROCm GPU keeps the library GEMM)."""
    impl = _impl(op, "triton_gemv", "gemv", op, probe_gemv, backward=False, accepts="accepts_" + op, quiet=True)
    return dataclasses.replace(impl, note=GEMV_NOTE, platforms=("cuda",))


def implementations() -> list[Implementation]:
    return [
        _impl("rms_norm", "triton", "rms_norm", "rms_norm"),
        _impl("add_rms_norm", "triton", "add_rms_norm", "add_rms_norm"),
        _impl("rotary", "triton", "rotary", "rotary", options=False),
        _impl("swiglu", "triton", "swiglu", "swiglu"),
        _impl(
            "rotary_kv_write",
            "triton",
            "rotary_kv_write",
            "rotary_kv_write",
            probe_inference,
            backward=False,
            accepts="accepts",
        ),  # fmt: skip
        _impl("linear_cross_entropy", "triton_chunked", "linear_cross_entropy", "linear_cross_entropy", options=False),
        # PEFT's LoRA on polyfuse's projections: the low-rank adds (output, input gradient) in one pass each.
        _impl("lora_linear", "triton", "lora_linear", "lora_linear", options=False),
        # Training's down projection: keeps no silu(gate) * up product (recomputed in the backward).
        _impl(
            "swiglu_linear",
            "triton_recompute",
            "swiglu_linear",
            "swiglu_linear",
            probe_training_fold,
            PRIORITY - 1,
            options=False,
        ),  # fmt: skip
        _gemv("linear"),
        _gemv("swiglu_linear"),
        # One-query decode steps only; prefill and anything else is declined to the next choice (SDPA).
        _impl(
            "attention",
            "triton_decode",
            "decode_attention",
            "decode_attention",
            probe_inference,
            PRIORITY + 10,
            backward=False,
            accepts="accepts",
            quiet=True,
        ),
        # Serving (polyfuse/serving): one query per sequence over the paged cache through its block table; prefill
        # chunks are declined to the next choice, the paged flash-attention prefill kernel.
        _impl(
            "paged_attention",
            "triton_paged_decode",
            "paged_attention",
            "paged_decode_attention",
            probe_inference,
            PRIORITY + 10,
            backward=False,
            accepts="accepts",
            quiet=True,
            options=False,
        ),
        _impl(
            "paged_attention",
            "triton_paged_prefill",
            "paged_attention",
            "paged_prefill_attention",
            probe_inference,
            PRIORITY,
            backward=False,
            accepts="accepts_prefill",
            options=False,
        ),  # fmt: skip
    ]


QUANT_NOTE = (
    "one row: Triton GEMV dequantizing int8/int4/fp8/fp8_block/gguf_q8_0/q4_0/q4_1/q4_k/q5_k/q6_k in its loads; "
    "int4 on int8 activations with int4_a8 (W4A8, dp4a); gguf_* on int8 activations unless gguf_a8 is off"
)
GEMM_NOTE = (
    "2..64 rows, int4/int8/fp8: Triton GEMM dequantizing in its loads (int4, 2..16 rows: nibbles as tensor-core "
    "operands, unless int4_mma is off); gguf_*, 2..8 rows with gguf_a8: rows quantized to int8, then the GGUF GEMV "
    "reading the weight once for all rows (dp4a); gguf_q4_0/q4_1 up to 64 rows, gguf_q8_0/q4_k up to 32: Triton "
    "GEMM dequantizing the blocks in its loads"
)
BLOCK_MM_NOTE = (
    "fp8_block, bf16, 2+ rows, Hopper: x quantized to e4m3 per token and 128 columns + torch._scaled_mm with 1 x 128 "
    "block scales"
)
DEQUANT_NOTE = (
    "int4/int8/fp8_block/GGUF (per-channel fp8 where no e4m3 GEMM takes it): one Triton dequantize kernel into the "
    "activations' dtype + F.linear"
)
SCALED_MM_NOTE = (
    "per-channel fp8, bf16, > 64 rows: x quantized to e4m3 per token by one Triton kernel + torch._scaled_mm"
)
SWIGLU_SCALED_MM_NOTE = (
    "per-channel fp8, bf16, > 64 rows: silu(gate) * up quantized to e4m3 per token in one Triton kernel + "
    "torch._scaled_mm"
)
NORM_GEMV_NOTE = (
    "one row, int4: the norm's kernel lets the GEMV launch before it waits, then the one-row GEMV (with int4_a8: "
    "the norm's kernel quantizing its row to int8); gguf_* with gguf_a8: the norm's kernel quantizing its row to "
    "int8, then the int8-activation GEMV"
)
NORM_SCALED_MM_NOTE = (
    "per-channel fp8, bf16, > 64 rows: the norm's rows quantized to e4m3 per token in the norm's kernel + "
    "torch._scaled_mm"
)
# Below the one-row GEMV (PRIORITY), above cuda:scaled_mm (fp8, PRIORITY - 10): a declined call walks
# gemv_q (1 row) -> gemm_q (2..64 rows, int4/int8/fp8; GGUF 2..8 on int8 activations, Q4_1/Q4_K to 32) ->
# fp8_block_mm (fp8_block, 2+ rows, sm90) -> dequant_mm (int4/int8/fp8_block/GGUF, any rows; fp8 where no e4m3 GEMM
# takes it) -> fp8_scaled_mm (fp8, more rows) -> cuda:scaled_mm -> native.
GEMM_PRIORITY = PRIORITY - 4
BLOCK_MM_PRIORITY = PRIORITY - 5
DEQUANT_PRIORITY = PRIORITY - 6
SCALED_MM_PRIORITY = PRIORITY - 8


def probe_scaled_mm(ctx: SelectionContext) -> Optional[str]:
    from polyfuse.ops.quant_linear import scaled_mm_probe

    if ctx.platform is not None and ctx.platform.name != "cuda":  # ROCm's fp8 is another e4m3 variant
        return f"row-wise e4m3fn scaled_mm: NVIDIA only (platform {ctx.platform.name})"
    return probe_inference(ctx) or scaled_mm_probe(ctx)


def probe_block_scaled_mm(ctx: SelectionContext) -> Optional[str]:
    """cuBLAS's 1 x 128 block-scaled fp8 through torch._scaled_mm: Hopper (9.0) with torch >= 2.9 and CUDA >= 12.9."""
    why = probe_inference(ctx)  # device, Triton, dtype, training: as every Triton implementation says them
    if why:
        return why
    cap = tuple(ctx.platform.capability or ()) if ctx.platform is not None else ()
    if ctx.platform is None or ctx.platform.name != "cuda" or cap != (9, 0):
        where = f"compute capability {cap[0]}.{cap[1]}" if cap else (ctx.platform.name if ctx.platform else "?")
        return f"cuBLAS block-scaled fp8 (1 x 128 scales): NVIDIA Hopper, compute capability 9.0 (this: {where})"
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if version < (2, 9) or cuda < (12, 9):
        return f"block-scaled torch._scaled_mm needs torch >= 2.9 with CUDA >= 12.9 (this: {torch.__version__})"
    if ctx.dtype != torch.bfloat16:
        return f"block-scaled fp8 needs bfloat16 (run is {str(ctx.dtype).replace('torch.', '')})"
    return None


def set_otherwise(ctx: SelectionContext, folded) -> Optional[str]:
    """Why a fused implementation folding other ops in yields to its composite (None: it does not): the run set one
    of ``folded`` ((op, the implementation the fold stands for) pairs) otherwise, by ``-op`` or ``op=<other>``, and
    the composite, which calls the run's own choice of each op, honours that."""
    from polyfuse.core.registry import run_overrides

    overrides = run_overrides(ctx)
    for op, ours in folded:
        choice = overrides.get(op)
        if choice is not None and choice not in ("+", ours):
            return f"{op} set by the run ({'-' + op if choice == '-' else op + '=' + choice}): the composite runs"
    return None


def probe_norm_scaled_mm(ctx: SelectionContext) -> Optional[str]:
    """add_rms_norm_linear_q's fp8 prefill form folds the norm and linear_q's activation quantization into one
    kernel: not where the run set either op otherwise (``-rms_norm``, ``-add_rms_norm``, ``-linear_q`` or another
    implementation named), so that its composite honours those choices."""
    folded = (("rms_norm", "triton"), ("add_rms_norm", "triton"), ("linear_q", "fp8_scaled_mm"))
    return set_otherwise(ctx, folded) or probe_scaled_mm(ctx)


def probe_norm_gemv(ctx: SelectionContext) -> Optional[str]:
    """add_rms_norm_linear_q's one-row int4 pair (norm_gemv_q.py): the run's Triton norms and its one-row GEMV, or the
    composite where the run set them otherwise."""
    folded = (("rms_norm", "triton"), ("add_rms_norm", "triton"), ("linear_q", "gemv_q"))
    return set_otherwise(ctx, folded) or probe_inference(ctx)


def probe_swiglu_fold(name: str, base):
    """swiglu_linear_q's fused forms fold SwiGLU into linear_q's ``name`` implementation: not where the run set
    ``swiglu`` or ``linear_q`` otherwise (``-swiglu``, ``swiglu=native``, ``-linear_q``, ...), where the composite
    (the run's SwiGLU, then its linear_q) runs; else ``base``."""

    def probe(ctx: SelectionContext) -> Optional[str]:
        return set_otherwise(ctx, (("swiglu", "triton"), ("linear_q", name))) or base(ctx)

    probe.__name__ = f"probe_swiglu_fold_{name}"
    return probe


def _quant(op, name, module, priority, note, probe=probe_inference, options=True):
    mod = f"polyfuse.backends.triton.quant.{module}"
    return Implementation(
        op, name, BACKEND, DEVICES, lazy_function(mod, op), priority, probe,
        supports_backward=False, note=note, platforms=PLATFORMS, accepts=lazy_function(mod, "accepts_" + op),
        quiet_decline=True, options=options,
    )  # fmt: skip


def quant_implementations() -> list[Implementation]:
    """The linear ops on quantized weights (polyfuse/ops/quant_linear.py): a one-row GEMV dequantizing in its loads
    (every format), a GEMM dequantizing in its loads for a few rows (int4, int8, fp8: batch decode), and for linear_q a
    dequantize kernel + F.linear for any rows (int4, int8: prefill) and fp8 activations quantized per token by one
    kernel + torch._scaled_mm (fp8, bf16: prefill; for swiglu_linear_q the same with SwiGLU in the quantizing kernel).
    Each declines (quietly: declining is the plan) what it does not take; the rest goes to the next choice, in the end
    the native dequantize + matmul (or, for swiglu_linear_q, the composite swiglu + linear_q, whose linear_q walks the
    same chain). ``add_rms_norm_linear_q`` has two forms: one row of int4, the norm's kernel launching the GEMV
    first (norm_gemv_q.py), and the fp8 prefill, the norm's kernel quantizing its rows; the rest goes to the composite
    (the run's norm, then its ``linear_q``)."""
    out = []
    for op in ("linear_q", "swiglu_linear_q"):
        fold = probe_swiglu_fold if op == "swiglu_linear_q" else (lambda name, base: base)
        out.append(_quant(op, "gemv_q", "gemv_q", PRIORITY, QUANT_NOTE, probe=fold("gemv_q", probe_inference)))
        out.append(_quant(op, "gemm_q", "gemm_q", GEMM_PRIORITY, GEMM_NOTE, probe=fold("gemm_q", probe_inference)))
        out.append(_quant(op, "fp8_scaled_mm", "fp8_scaled_mm", SCALED_MM_PRIORITY,
                          SWIGLU_SCALED_MM_NOTE if op == "swiglu_linear_q" else SCALED_MM_NOTE,
                          probe=fold("fp8_scaled_mm", probe_scaled_mm)))  # fmt: skip
    out.append(_quant("linear_q", "fp8_block_mm", "fp8_block_mm", BLOCK_MM_PRIORITY, BLOCK_MM_NOTE,
                      probe=probe_block_scaled_mm, options=False))  # fmt: skip
    out.append(_quant("linear_q", "dequant_mm", "dequant_mm", DEQUANT_PRIORITY, DEQUANT_NOTE, options=False))
    out.append(
        _quant("add_rms_norm_linear_q", "gemv_q", "norm_gemv_q", PRIORITY, NORM_GEMV_NOTE, probe=probe_norm_gemv)
    )
    out.append(
        _quant(
            "add_rms_norm_linear_q",
            "fp8_scaled_mm",
            "norm_fp8_scaled_mm",
            SCALED_MM_PRIORITY,
            NORM_SCALED_MM_NOTE,
            probe=probe_norm_scaled_mm,
        )
    )
    return out


_done = []


def register() -> None:
    """The ``polyfuse.backends`` entry point ``triton``."""
    if not _done:
        for impl in implementations() + quant_implementations():
            register_impl(impl)
        _done.append(True)
