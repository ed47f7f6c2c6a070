#!/usr/bin/env python
"""Decode-time linear layers (one row, M=1) on the real weight shapes: cuBLAS, cuBLASLt and the Triton GEMV; with
--quant, the quantized-weight kernels beside them (int4 / int8 / fp8: the one-row GEMV and the dequantizing GEMM for
batch decode; int4 / int8 / GGUF: dequantize + cuBLAS for prefill; GGUF types: the one-row GEMV; and the native
reference they replace).

    python benchmarks/benchmark_linear.py --output linear.jsonl     # NVIDIA GPU only
    python benchmarks/benchmark_linear.py --shapes 8b.o,8b.qkv,8b.gate_up,8b.down --rows 1,16,64,256,2048 --no-triton \
        --quant int4,int8,fp8                                      # bf16 cuBLAS vs the quantized kernels
    python benchmarks/benchmark_linear.py --shapes 8b.o,8b.down,8b.gate_up --rows 16 --no-triton --quant int4 --qsweep

Each case is timed as a CUDA graph of back-to-back calls over rotating weight copies (more bytes than the L2 holds,
so every call reads its weight from HBM, as in decode), reporting microseconds per call and the weight bytes read
per second (quantized rows: the packed bytes with their scales) and TFLOP/s. The SwiGLU rows compare the down
projection after the separate SwiGLU kernel with the GEMV (GEMM) that applies SwiGLU while loading its input. Every
quantized row is checked against F.linear on the dequantized weight first (an ``error`` row when it is off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.harness.report import append_result, run_meta  # noqa: E402


SHAPES = {  # name: (N, K)
    "8b.qkv": (6144, 4096),
    "8b.o": (4096, 4096),
    "8b.gate_up": (28672, 4096),
    "8b.down": (4096, 14336),
    "8b.lm_head": (128256, 4096),
    "7b.qkv": (12288, 4096),
    "7b.gate_up": (22016, 4096),
    "7b.down": (4096, 11008),
    "7b.lm_head": (32000, 4096),
    "13b.qkv": (15360, 5120),
    "13b.o": (5120, 5120),
    "13b.gate_up": (27648, 5120),
    "13b.down": (5120, 13824),
    "13b.lm_head": (32000, 5120),
    "70b.qkv": (10240, 8192),
    "70b.o": (8192, 8192),
    "70b.gate_up": (57344, 8192),
    "70b.down": (8192, 28672),
    # One rank's shard under tensor parallelism over 2 GPUs (docs/distributed.md): column-parallel qkv / gate_up /
    # LM head (N halved), row-parallel o / down (K halved).
    "8b-tp2.qkv": (3072, 4096),
    "8b-tp2.o": (4096, 2048),
    "8b-tp2.gate_up": (14336, 4096),
    "8b-tp2.down": (4096, 7168),
    "8b-tp2.lm_head": (64128, 4096),
    "70b-tp2.qkv": (5120, 8192),
    "70b-tp2.o": (8192, 4096),
    "70b-tp2.gate_up": (28672, 8192),
    "70b-tp2.down": (8192, 14336),
    "70b-tp2.lm_head": (16000, 8192),
}
CONFIGS = [  # block_n, block_k, num_warps, num_stages
    (bn, bk, nw, ns)
    for bn, bk in ((4, 1024), (8, 512), (8, 1024), (16, 512), (16, 1024), (4, 2048), (8, 2048), (16, 2048), (32, 512),
                   (64, 128), (32, 1024), (4, 4096))
    for nw in (4, 8)
    for ns in (2, 3)
    if bn * bk <= 32768
]  # fmt: skip
# --qsweep: dequantizing GEMM tiles (block_n, block_k, num_warps, num_stages; block_m from the rows), beside the default
QCONFIGS = [(bn, bk, nw, ns) for bn in (32, 64, 128) for bk in (64, 128) for nw in (4, 8) for ns in (2, 4)]
# --gemv_sweep: the quantized one-row GEMV's tiles (block_n, block_k, num_warps, num_stages) per weight layout. The
# K loop is software-pipelined (num_stages tiles in flight, in shared memory): tiles up to 32 KB per stage.
GEMV_QCONFIGS = {
    "int4": [(bn, bk, 4, ns) for bn, bk in ((128, 128), (256, 64), (256, 128), (512, 32), (512, 64), (1024, 32))
             for ns in (2, 3, 4)] + [(bn, bk, 8, ns) for bn, bk in ((512, 64), (1024, 32), (2048, 32)) for ns in (3, 4)]
    + [(bn, bk, nw, ns) for bn, bk, nw in ((1024, 16, 4), (2048, 16, 4), (2048, 8, 4), (2048, 16, 8), (4096, 16, 8))
       for ns in (2, 3, 4)],
    "bytes": [(bn, bk, 4, ns) for bn, bk in ((4, 2048), (8, 1024), (8, 2048), (16, 512), (16, 1024), (32, 256))
              for ns in (2, 3, 4)] + [(bn, bk, 8, ns) for bn, bk in ((8, 2048), (16, 1024)) for ns in (3, 4)],
    # GGUF K-quants (gemv_gguf_kquant.py): rows per program; block_k / 256 super-blocks per step
    "kquant": [(bn, bk, nw, ns) for bn in (4, 8, 16, 32) for bk in (256, 512) for nw in (1, 2, 4) for ns in (2, 3)],
}  # fmt: skip


def best_tiles(rows: list) -> dict:
    """{"gemv" | "gemm": {"format@rows": {"tile": [...], "us_sum": us}}}: per format and row count, the swept tile with the least time summed over every shape
    it ran on (a tile missing on a shape, by error, does not qualify): the "tile" entries of a tile_configs folder's
    qgemv / qgemm tables (polyfuse/backends/triton/tuned.py)."""
    import re

    found: dict = {}
    shapes: dict = {}
    for r in rows:
        m = re.fullmatch(r"(int4|int8|fp8|gguf_\w+?)_(gemv|gemm)_(\d+)x(\d+)_w(\d+)s(\d+)", r.get("impl", ""))
        if not m or "us" not in r:
            continue
        fmt, kind, tile = m.group(1), m.group(2), tuple(int(v) for v in m.groups()[2:])
        key = (kind, fmt, r["M"])
        shapes.setdefault(key, set()).add(r["shape"])
        found.setdefault(key, {}).setdefault(tile, {})[r["shape"]] = r["us"]
    best: dict = {}
    for (kind, fmt, m), by_tile in found.items():
        full = {t: sum(v.values()) for t, v in by_tile.items() if len(v) == len(shapes[(kind, fmt, m)])}
        if full:
            tile = min(full, key=full.get)
            best.setdefault(kind, {})[f"{fmt}@{m}"] = {"tile": list(tile), "us_sum": round(full[tile], 2)}
    return best


def graph_time(fn, reps: int) -> float:
    """Seconds per call of ``fn(i)`` for i in range(reps), captured once in a CUDA graph, median of 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(reps):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return sorted(times[1:])[2]


def time_quantized(fmt, name, n, k, m, w, x, up, args, log) -> dict:
    """{impl: (seconds per call, bytes read)} for the ``fmt`` kernels on weight ``w`` and ``m`` rows of ``x``."""
    from polyfuse.backends.triton.quant import gemm_common
    from polyfuse.backends.triton.quant.dequant_mm import linear_q as dequant_mm
    from polyfuse.backends.triton.quant.gemm_int4 import gemm_int4
    from polyfuse.backends.triton.quant.gemm_int8_fp8 import gemm_int8_fp8
    from polyfuse.backends.triton.quant.gemv_q import linear_q as gemv_q
    from polyfuse.backends.triton.quant.gemv_q import swiglu_linear_q as gemv_q_swiglu
    from polyfuse.backends.triton.swiglu import swiglu
    from polyfuse.ops.quant_formats import K_QUANTS, dequantize, quantize
    from polyfuse.ops.quant_linear import linear_q_native

    qw = quantize(fmt, w.float())
    tensors = [f.name for f in dataclasses.fields(qw) if isinstance(getattr(qw, f.name), torch.Tensor)]
    qbytes = sum(getattr(qw, t).nbytes for t in tensors)
    copies = max(2, min(32, -(-(2 << 30) // qbytes)))
    qws = [qw] + [dataclasses.replace(qw, **{t: getattr(qw, t).clone() for t in tensors}) for _ in range(copies - 1)]
    gemm = {"int4": gemm_int4, "int8": gemm_int8_fp8, "fp8": gemm_int8_fp8}.get(fmt)
    wd = dequantize(qw, x.dtype)
    ref, sref = F.linear(x, wd).float(), F.linear(swiglu(x, up), wd).float()
    fns = {f"{fmt}_native": lambda q: linear_q_native(x, q)}
    dequant = fmt in ("int4", "int8") or fmt.startswith("gguf")
    if dequant:  # dequant_mm.py's formats (fp8 prefill takes triton:fp8_scaled_mm)
        fns[f"{fmt}_dequant_cublas"] = lambda q: dequant_mm(x, q)
    if gemm is not None:
        fns[f"{fmt}_gemm"] = lambda q: gemm(x, None, q)
    if fmt == "int4" and args.reshape:
        fns["int4_gemm_reshape"] = lambda q: gemm(x, None, q, reshape=True)
    if m == 1:
        fns[f"{fmt}_gemv"] = lambda q: gemv_q(x, q)
        if args.gemv_sweep:  # the one-row GEMV's tiles (polyfuse/backends/triton/configs/qgemv)
            from polyfuse.backends.triton.quant.gemv_gguf import gemv_gguf
            from polyfuse.backends.triton.quant.gemv_gguf_kquant import gemv_gguf_kquant
            from polyfuse.backends.triton.quant.gemv_int4 import gemv_int4
            from polyfuse.backends.triton.quant.gemv_int8_fp8 import gemv_int8_fp8

            kquant = fmt in K_QUANTS
            kernel = {"int4": gemv_int4}.get(
                fmt, gemv_gguf_kquant if kquant else gemv_gguf if "gguf" in fmt else gemv_int8_fp8
            )
            for cfg in GEMV_QCONFIGS["int4" if fmt == "int4" else "kquant" if kquant else "bytes"]:
                tag = f"{fmt}_gemv_{cfg[0]}x{cfg[1]}_w{cfg[2]}s{cfg[3]}"
                fns[tag] = lambda q, cfg=cfg, kernel=kernel: kernel(x, None, q, tiles=cfg)
    if args.qsweep and gemm is not None:
        for cfg in QCONFIGS:
            if fmt == "int4" and cfg[1] > qw.group_size:
                continue
            fns[f"{fmt}_gemm_{cfg[0]}x{cfg[1]}_w{cfg[2]}s{cfg[3]}"] = lambda q, cfg=cfg: gemm(x, None, q, tiles=cfg)
    if name.endswith("down"):
        if dequant:
            fns[f"swiglu+{fmt}_dequant_cublas"] = lambda q: dequant_mm(swiglu(x, up), q)
        if gemm is not None:
            fns[f"swiglu+{fmt}_gemm"] = lambda q: gemm(x, up, q)
        if m == 1:
            fns[f"swiglu+{fmt}_gemv"] = lambda q: gemv_q_swiglu(x, up, q)
    out = {}
    for impl, fn in fns.items():
        try:
            want = sref if impl.startswith("swiglu+") else ref
            err = ((fn(qw).float() - want).norm() / want.norm()).item()
            if err > 1e-2:
                log(dict(shape=name, M=m, impl=impl, error=f"relative error {err:.2e}"))
                continue
            out[impl] = (graph_time(lambda i, fn=fn: fn(qws[i % copies]), copies), qbytes)
        except Exception as e:  # a config that does not compile must not stop the sweep
            log(dict(shape=name, M=m, impl=impl, error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__))
    if gemm is not None:
        tiles = gemm_common.tiles_for(fmt, m, None, x.device)
        log(dict(shape=name, M=m, what=f"{fmt}_gemm default tiles", tiles=tiles,
                 split=gemm_common.launch_plan(m, n, k, x.device, tiles)[2]))  # fmt: skip
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1", help="comma list of M (rows)")
    p.add_argument("--triton", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output", default=None)
    p.add_argument("--results", default=None, help="append the timed rows, with the date, device, versions and "
                   "command, to this JSON-lines file or to linear.jsonl in this folder (benchmarks/results)")  # fmt: skip
    p.add_argument(
        "--quant",
        default="",
        help="comma list of weight formats to time beside bf16: int4, int8, fp8, fp8_block, gguf_q8_0, gguf_q4_0, "
        "gguf_q4_1, gguf_q4_k, gguf_q6_k",
    )
    p.add_argument("--gemv_sweep", action="store_true", help="with --quant and rows 1: sweep the one-row GEMV's tiles")
    p.add_argument("--qsweep", action="store_true", help="with --quant: also sweep the GEMM's tiles (QCONFIGS)")
    p.add_argument(
        "--reshape",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --quant int4: also time the GEMM unpacking words once + reshape (gemm_int4's reshape=True)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_linear.py: error: needs an NVIDIA GPU", file=sys.stderr)
        raise SystemExit(2)
    from polyfuse.backends.triton.gemv import gemv
    from polyfuse.backends.triton.swiglu import swiglu

    out = open(args.output, "a") if args.output else None
    dev, dt = torch.device("cuda"), torch.bfloat16
    meta = run_meta(torch.cuda.get_device_name()) if args.results else None

    logged = []

    def log(row):
        logged.append(row)
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        if "us" in row:
            append_result(args.results, {"what": "linear", **row}, meta)

    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, min(32, -(-(2 << 30) // nbytes)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            up = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x, ws[0])
            cases = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                cases[lib] = graph_time(lambda i: F.linear(x, ws[i % copies]), copies)
                if name.endswith("down"):
                    cases[f"swiglu+{lib}"] = graph_time(lambda i: F.linear(swiglu(x, up), ws[i % copies]), copies)
            torch.backends.cuda.preferred_blas_library("cublas")
            if args.triton:
                for bn, bk, nw, ns in CONFIGS:
                    kw = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                    tag = f"triton_{bn}x{bk}_w{nw}s{ns}"
                    try:
                        err = ((gemv(x, ws[0], **kw).float() - ref.float()).norm() / ref.float().norm()).item()
                        cases[tag] = graph_time(lambda i: gemv(x, ws[i % copies], **kw), copies)
                        if name.endswith("down"):
                            sref = F.linear(swiglu(x, up), ws[0]).float()
                            gerr = ((gemv(x, ws[0], up=up, **kw).float() - sref).norm() / sref.norm()).item()
                            cases["swiglu+" + tag] = graph_time(lambda i: gemv(x, ws[i % copies], up=up, **kw), copies)
                            err = max(err, gerr)
                        if err > 1e-2:
                            log(dict(shape=name, M=m, impl=tag, error=f"relative error {err:.2e}"))
                    except Exception as e:  # a config that does not compile must not stop the sweep
                        log(dict(shape=name, M=m, impl=tag, error=str(e).splitlines()[0][:200]))
            rows = {impl: (sec, nbytes) for impl, sec in cases.items()}
            for fmt in [f for f in args.quant.split(",") if f]:
                rows.update(time_quantized(fmt, name, n, k, m, ws[0], x, up, args, log))
            for impl, (sec, nb) in sorted(rows.items(), key=lambda kv: kv[1][0]):
                log(dict(shape=name, M=m, impl=impl, us=round(sec * 1e6, 2), TBps=round(nb / sec / 1e12, 3),
                         TFLOPs=round(2 * m * n * k / sec / 1e12, 1)))  # fmt: skip
        ws.clear()
        torch.cuda.empty_cache()
    if args.gemv_sweep or args.qsweep:
        log({"best_tiles": best_tiles(logged)})


if __name__ == "__main__":
    main()
