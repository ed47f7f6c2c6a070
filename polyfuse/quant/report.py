"""What a quantized model says about itself: ``--print_backends``' lines (formats, stacks, the kernels that take
them) and the one warning where fp8 weights get no fp8 matmul."""

from __future__ import annotations

import logging

import torch

from polyfuse.ops.quant_formats import describe
from polyfuse.quant.qlinear import QLinearStack, head_quantized, quantized_modules
from polyfuse.quant.quantize import _candidates, _name


logger = logging.getLogger("polyfuse")


def report(model) -> str:
    """What ``--print_backends`` adds for a quantized model: the formats, what kept its dtype, the kernels."""
    qs = quantized_modules(model)
    if not qs:
        return ""
    counts: dict = {}
    for q in qs.values():
        key = describe(q.format, q.group_size) + (" (act-order)" if q.act_order else "")
        counts[key] = counts.get(key, 0) + 1
    dense, dtype = len(_candidates(model)), _name(model.dtype)
    head = "" if head_quantized(model) else " and the LM head"
    stacks = [m for m in model.modules() if isinstance(m, QLinearStack)]
    projections = len(qs) - sum(len(s.segments) - 1 for s in stacks)  # a stack is one projection of its segments
    lines = [f"quantized weights: {projections} projection(s); {dense} other projection(s){head} in {dtype}"]
    lines += [f"  {fmt}: {n}" for fmt, n in counts.items()]  # per packed weight: a stack's segments one by one
    if stacks:
        lines.append(f"  {len(stacks)} fused projection(s) with parts in different formats: "
                     f"{sum(len(s.segments) for s in stacks)} packed weights, one projection each")  # fmt: skip
    kernels = getattr(model, "kernels", None)
    if kernels is not None:
        from polyfuse.core.registry import NATIVE, ops

        for op in ("linear_q", "swiglu_linear_q"):
            c, spec = kernels.choices[op], ops()[op]
            last = "composite " + " + ".join(spec.composed_of) if spec.compose else "native (dequantize + F.linear)"
            chain = [f"{i.backend}:{i.name}" for i in c.chain if i.name != NATIVE] + [last]
            lines.append(f"  {op}: {' -> '.join(chain)}")
    return "\n".join(lines)


# Habana's linear_q kernels (backends/hpu): the format each takes and the activation dtypes it runs on.
HPU_KERNELS = {"fp8_gemm": ("fp8", (torch.bfloat16, torch.float32)), "uint4_matmul": ("int4", (torch.bfloat16,))}


def warn_unaccelerated(model) -> None:
    """fp8 weights where no fp8 matmul runs, and on Gaudi any format no Habana kernel takes: say once what runs
    instead."""
    _warn_hpu_formats(model)
    fmts = {q.format for q in quantized_modules(model).values()}
    if not fmts & {"fp8", "fp8_block"}:
        return
    platform = model.kernels.context.platform
    cap = tuple(platform.capability or ())
    if platform.name == "cuda" and cap >= (8, 9) and model.dtype == torch.bfloat16 and "fp8" in fmts:
        return
    if model.kernels.choices["linear_q"].implementation.name == "fp8_gemm":  # Habana's fp8 GEMM (backends/hpu)
        if model.dtype not in (torch.bfloat16, torch.float32):
            where = f"hpu, a {_name(model.dtype)} run: Habana's fp8 GEMM takes bfloat16 or float32 activations"
        elif "fp8_block" in fmts:
            where = "hpu: fp8_block weights (Habana's fp8 GEMM here takes per-channel fp8)"
        else:
            return
        logger.warning("warning: fp8 weights on %s; they stay fp8 and every call dequantizes them", where)
        return
    if platform.name != "cuda":
        where = f"{platform.name}: no fp8 matmul here"
    elif cap < (8, 9):
        where = f"{platform.device_name} (compute capability {'.'.join(map(str, cap))}): no fp8 tensor cores"
    elif model.dtype != torch.bfloat16:
        where = f"{_name(model.dtype)} run: the fp8 matmul (row-wise torch._scaled_mm) needs bfloat16"
    elif any(i.name == "fp8_block_mm" for i in model.kernels.choices["linear_q"].then):
        return  # Hopper: fp8_block's prefill runs the block-scaled fp8 GEMM (backends/triton/quant/fp8_block_mm.py)
    else:
        where = "fp8_block weights: no block-scaled fp8 matmul here (it needs Hopper, torch >= 2.9 and CUDA >= 12.9)"
    c = model.kernels.choices["linear_q"]
    impl = c.implementation
    gemm = next((i for i in c.then if i.name == "gemm_q"), None)  # per-channel fp8 (not fp8_block), 2..64 rows
    batch = f", 2..64 rows {gemm.backend}:{gemm.name}" if gemm is not None and "fp8" in fmts else ""
    deq = next((i for i in c.then if i.name == "dequant_mm"), None)  # one dequantize kernel, then F.linear
    rest = f"other calls {deq.backend}:{deq.name}" if deq is not None else "other calls dequantize them"
    runs = (
        "every call dequantizes them"
        if impl.name == "native" or platform.name == "hpu"  # on Gaudi only fp8_gemm (above) takes fp8
        else f"one-row decode runs {impl.backend}:{impl.name}{batch}, {rest}"
    )
    logger.warning("warning: fp8 weights on %s; they stay fp8 and %s (dequantize + F.linear)", where, runs)


def _warn_hpu_formats(model) -> None:
    """On Gaudi: one line for the formats other than fp8 that no Habana kernel takes in this run (int8, GGUF kept
    types; int4 where Habana's 4-bit dequantization is missing or the run is not bfloat16; fp8 has its own lines)."""
    if model.kernels.context.platform.name != "hpu":
        return
    chain = [HPU_KERNELS[i.name] for i in model.kernels.choices["linear_q"].chain if i.name in HPU_KERNELS]
    taken = {fmt for fmt, dtypes in chain if model.dtype in dtypes}
    left = sorted({q.format for q in quantized_modules(model).values()} - taken - {"fp8", "fp8_block"})
    if left:
        logger.warning(
            "warning: %s weights on hpu, a %s run: no Habana kernel takes them here; they stay packed and "
            "every call dequantizes them (dequantize + F.linear)",
            ", ".join(left),
            _name(model.dtype),
        )
