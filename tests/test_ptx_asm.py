"""The quantized GEMVs' inline PTX (int4: nibbles to floats by byte permutes, gemv_gptq.py; int8: bytes to floats,
gemv_scaled.py) assembled for an H100/H200 (sm_90) without a GPU: Triton compiles each kernel as a launch would
(16-divisible pointers and sizes) down to a cubin with the ptxas it ships. The CPU suite runs these kernels under the
interpreter, which takes the Triton-arithmetic branch; this is what catches a PTX typo before the GPU does. The GPU
conformance suite checks the numbers (tests/test_kernels_conformance.py, linear_q:gemv_q on cuda)."""

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from polyfuse.backends.triton import gemv_gptq, gemv_scaled

def compile_(fn, sig, consts):
    args = [k for k in sig if sig[k] != "constexpr"]
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k] != "constexpr"}
    src = ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    assert k.asm["cubin"], "no cubin"
    return k.asm["ptx"]

common = {"X": "*bf16", "U": "*bf16"}
sig = dict(common, QW="*i32", QZ="*i32", S="*bf16", GI="*i32", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32",
           N="i32", K8="i32", G_SIZE="i32", sq_k="i32", sz_g="i32", ss_g="i32", k8_per_split="i32")
consts = dict(SWIGLU=False, ACT_ORDER=False, HAS_BIAS=False, SPLIT=1, BLOCK_N=512, BLOCK_K8=8, STAGES=3, PDL=False,
              ASM=True, XBLOCK=128)
sig.update({k: "constexpr" for k in consts})
ptx = compile_(gemv_gptq._gemv_gptq_kernel, sig, consts)
assert ptx.count("prmt.b32") >= 8, "int4 permutes missing"
sig = dict(common, W="*i8", S="*fp32", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32", N="i32", K="i32", sw_n="i32",
           ss_n="i32", k_per_split="i32")
consts = dict(SWIGLU=False, GROUP=0, FP8_BITS=False, INT8=True, HAS_BIAS=False, SPLIT=1, BLOCK_N=32, BLOCK_K=256,
              STAGES=3, ASM=True, PDL=False)
sig.update({k: "constexpr" for k in consts})
ptx = compile_(gemv_scaled._gemv_scaled_kernel, sig, consts)
assert ptx.count("prmt.b32") >= 4, "int8 permutes missing"
print("ok")
"""


def test_inline_ptx_of_the_quantized_gemvs_assembles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
