#!/usr/bin/env python
"""Decode-time linear layers (one row, M=1) on the real weight shapes: cuBLAS, cuBLASLt and the Triton GEMV.

    python examples/benchmark_linear.py --output linear.jsonl     # NVIDIA GPU only

Each case is timed as a CUDA graph of back-to-back calls over rotating weight copies (more bytes than the L2 holds,
so every call reads its weight from HBM, as in decode), reporting microseconds per call and the weight bytes read
per second. The SwiGLU rows compare the down projection after the separate SwiGLU kernel with the GEMV that applies
SwiGLU while loading its input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


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
}
CONFIGS = [  # block_n, block_k, num_warps, num_stages
    (bn, bk, nw, ns)
    for bn, bk in ((4, 1024), (8, 512), (8, 1024), (16, 512), (16, 1024), (4, 2048), (8, 2048), (16, 2048), (32, 512),
                   (64, 128), (32, 1024), (4, 4096))
    for nw in (4, 8)
    for ns in (2, 3)
    if bn * bk <= 32768
]  # fmt: skip


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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1", help="comma list of M (rows)")
    p.add_argument("--triton", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_linear.py: error: needs an NVIDIA GPU", file=sys.stderr)
        raise SystemExit(2)
    from polyfuse.backends.triton.gemv import gemv
    from polyfuse.backends.triton.swiglu import swiglu

    out = open(args.output, "a") if args.output else None
    dev, dt = torch.device("cuda"), torch.bfloat16

    def log(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

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
            for impl, s in sorted(cases.items(), key=lambda kv: kv[1]):
                log(dict(shape=name, M=m, impl=impl, us=round(s * 1e6, 2), TBps=round(nbytes / s / 1e12, 3)))
        ws.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
