"""The quantized GEMVs' inline PTX (int4: nibbles to floats by byte permutes, gemv_int4.py, and to bf16 / fp16 mma
operands, gemm_int4_mma.py; int8: bytes to floats, gemv_int8_fp8.py) without a GPU. (1) Assembled for an H100/H200 (sm_90): Triton compiles each kernel as a launch would
(16-divisible pointers and sizes) down to a cubin with the ptxas it ships; a PTX typo fails here. (2) Executed: the
asm's own instructions (read from the kernel source: shifts, masks, the permute selectors) emulated on random words
must give the numbers of the Triton-arithmetic branch that the CPU suite runs under the interpreter. The GPU
conformance suite checks the kernels' results (tests/test_kernels_conformance.py, linear_q:gemv_q on cuda)."""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from polyfuse.backends.triton.quant import act_int8, gemv_int4, gemv_int4_a8, gemv_gguf_a8, gemm_int4_mma, gemv_gguf_kquant_a8, gemv_int8_fp8

def compile_(fn, sig, consts):
    sig = {name: sig[name] for name in fn.arg_names}  # the kernel's parameter order (older Tritons read it by position)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k] != "constexpr"}
    src = ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    assert k.asm["cubin"], "no cubin"
    return k.asm["ptx"]

common = {"X": "*bf16", "U": "*bf16"}
sig = dict(common, QW="*i32", QZ="*i32", S="*bf16", GI="*i32", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32",
           N="i32", K8="i32", G_SIZE="i32", sq_k="i32", sz_g="i32", ss_g="i32", k8_per_split="i32", SPLIT="i32")
consts = dict(SWIGLU=False, ACT_ORDER=False, HAS_BIAS=False, BLOCK_N=512, BLOCK_K8=8, STAGES=3, PDL=False,
              ASM=True, XBLOCK=128, PRE=1, UNROLL=8)
sig.update({k: "constexpr" for k in consts})
ptx = compile_(gemv_int4._gemv_gptq_kernel, sig, consts)
assert ptx.count("prmt.b32") >= 8, "int4 permutes missing"
# with PDL (a Triton that has it): the early weight tile is loaded before griddepcontrol.wait
ptx = compile_(gemv_int4._gemv_gptq_kernel, sig, dict(consts, PDL=True))
if "griddepcontrol.wait" in ptx:
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global.cg" in ptx[:wait], "the early weight tile is not loaded before the wait"
sig = dict(common, W="*i8", S="*fp32", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32", N="i32", K="i32", sw_n="i32",
           ss_n="i32", k_per_split="i32", SPLIT="i32")
consts = dict(SWIGLU=False, GROUP=0, FP8_BITS=False, INT8=True, HAS_BIAS=False, BLOCK_N=32, BLOCK_K=256,
              STAGES=3, ASM=True, PDL=False, PRE=2, UNROLL=8)
sig.update({k: "constexpr" for k in consts})
ptx = compile_(gemv_int8_fp8._gemv_scaled_kernel, sig, consts)
assert ptx.count("prmt.b32") >= 4, "int8 permutes missing"
sig = dict(X="*bf16", QW="*i32", QZ="*i32", S="*bf16", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32", M="i32", N="i32",
           K8="i32", G_SIZE="i32", sx_m="i32", sy_m="i32", sq_k="i32", sz_g="i32", ss_g="i32", k8_per_split="i32",
           SPLIT="i32")
for fp16 in (False, True):
    consts = dict(HAS_BIAS=False, BLOCK_N=256, STAGES=3, PDL=False, ASM=True, FP16=fp16, XBLOCK=128)
    sig.update({k: "constexpr" for k in consts})
    if fp16:
        sig.update(X="*fp16", S="*fp16", B="*fp16", Y="*fp16")
    ptx = compile_(gemm_int4_mma._gemv_gptq_mma_kernel, sig, consts)
    assert ptx.count("lop3.b32") >= 8 and "mma.sync" in ptx, "int4 mma: the plane decode or the mma is missing"
sig = dict(XW="*i32", DX="*fp32", RS="*fp32", QW="*i32", QZ="*i32", S="*fp16", B="*bf16", Y="*bf16", WS="*fp32",
           CNT="*i32", N="i32", K8="i32", G_SIZE="i32", sz_g="i32", ss_g="i32", k8_per_split="i32",
           SPLIT="i32")
consts = dict(SQ_K=28672, EVEN=True, HAS_BIAS=False, BLOCK_N=256, BLOCK_K8=8, STAGES=2, PDL=False, ASM=True, RBLOCK=16, PRE=2, UNROLL=8)
sig.update({k: "constexpr" for k in consts})
ptx = compile_(gemv_int4_a8._gemv_gptq_a8_kernel, sig, consts)
assert ptx.count("dp4a.u32.s32") >= 16, "W4A8: the integer dot products are missing"
sig = dict(X="*bf16", U="*bf16", XW="*i32", DX="*fp32", RS="*fp32", K="i32", sx="i32", su="i32")
for natural in (False, True):
    consts = dict(SWIGLU=True, BLOCK=1024, PDL=False, ASM=True, NATURAL=natural)
    sig.update({k: "constexpr" for k in consts})
    assert "mul.rn.f32" in compile_(act_int8._quantize_kernel, sig, consts), "int8 activations: the rounded product"
sig = dict(X="*bf16", RES="*bf16", R="*bf16", W="*bf16", XW="*i32", DX="*fp32", RS="*fp32", H="i32", eps="fp32")
for natural in (False, True):
    consts = dict(HAS_RES=True, BLOCK=4096, PDL=False, ASM=True, NATURAL=natural)
    sig.update({k: "constexpr" for k in consts})
    assert "mul.rn.f32" in compile_(act_int8._norm_quantize_kernel, sig, consts)
# the GGUF A8 GEMVs at one activation row (BLOCK_N weight rows a program) and at 8 (one weight row a program)
ROW_FORMS = ((2, 1), (1, 8))
sig = dict(XW="*i32", DX="*fp32", RS="*fp32", W32="*i32", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32", N="i32",
           NB="i32", row_words="i32", nb_per_split="i32", ROWS="i32", SPLIT="i32")
for q5 in (False, True):
    for block_n, m in ROW_FORMS:
        consts = dict(Q5=q5, WORDS=44 if q5 else 36, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_B=8, M=m, PDL=False,
                      ASM=True)
        sig.update({k: "constexpr" for k in consts})
        ptx = compile_(gemv_gguf_kquant_a8._gemv_kquant_a8_kernel, sig, consts)
        assert ptx.count("dp4a.u32.s32") >= 8, "K-quant A8: the integer dot products are missing"  # 2 x 8 x 32 x 2 / 128
sig = dict(XW="*i32", DX="*fp32", W8="*i8", W16="*i16", W32="*i32", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32",
           N="i32", NB="i32", row_halves="i32", nb_per_split="i32", ROWS="i32", SPLIT="i32")
for paired in (False, True):
    for block_n, m in ROW_FORMS:
        consts = dict(PAIRED=paired, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_B=4, M=m, PDL=False, ASM=True)
        sig.update({k: "constexpr" for k in consts})
        ptx = compile_(gemv_gguf_kquant_a8._gemv_q6k_a8_kernel, sig, consts)
        assert ptx.count("dp4a.u32.s32") >= 4, "Q6_K A8: the integer dot products are missing"  # 2 x 32 x 8 / 128
sig = dict(XW="*i32", DX="*fp32", RS="*fp32", W32="*i32", B="*bf16", Y="*bf16", WS="*fp32", CNT="*i32", N="i32",
           NB="i32", row_words="i32", nb_per_split="i32", ROWS="i32", SPLIT="i32")
for fmt, (code, words, pairs) in gemv_gguf_a8.LAYOUT.items():
    for block_n, m in ((8, 1), (1, 8)):
        consts = dict(FMT=code, Q=words, PAIRED=pairs, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_B=32, M=m, PDL=False,
                      ASM=True)
        sig.update({k: "constexpr" for k in consts})
        ptx = compile_(gemv_gguf_a8._gemv_gguf_a8_kernel, sig, consts)
        op = "dp4a.s32.s32" if code == 0 else "dp4a.u32.s32"
        assert ptx.count(op) >= 8, f"{fmt} A8: the integer dot products are missing"  # 8 x 32 x 8 / 128 threads
print("ok")
"""


@pytest.mark.slow
def test_inline_ptx_of_the_quantized_gemvs_assembles_for_sm90():
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton ships no ptxas (no NVIDIA backend)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode): byte i of the result is byte (sel >> 4 i) & 7 of {b, a} (a = bytes 0-3)."""
    out = np.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        assert s < 8, "sign-replicating selectors are not used"
        src = a if s < 4 else b
        out |= ((src >> np.uint32(8 * (s % 4))) & np.uint32(0xFF)) << np.uint32(8 * i)
    return out


def _asm_of(fn) -> str:
    return re.search(r'asm="""(.*?)"""', inspect.getsource(fn), re.S).group(1)


def test_int4_permutes_give_the_interpreter_branch_numbers():
    from polyfuse.backends.triton.quant import gemv_int4

    asm = _asm_of(gemv_int4._nibbles_f32.fn)
    words = np.random.default_rng(0).integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    words[:2] = [0, 0xFFFFFFFF]
    shl, e_mask = re.search(r"shl\.b32 e, \$8, (\d+);\s*and\.b32 e, e, (0x[0-9A-Fa-f]+);", asm).groups()
    shr, o_mask = re.search(r"shr\.u32 o, \$8, (\d+);\s*and\.b32 o, o, (0x[0-9A-Fa-f]+);", asm).groups()
    m = np.full_like(words, int(re.search(r"mov\.b32 m, (0x[0-9A-Fa-f]+);", asm).group(1), 16))
    regs = {"e": (words << np.uint32(int(shl))) & np.uint32(int(e_mask, 16)),
            "o": (words >> np.uint32(int(shr))) & np.uint32(int(o_mask, 16))}  # fmt: skip
    found = re.findall(r"prmt\.b32 \$(\d), (e|o), m, (0x[0-9A-Fa-f]+);", asm)
    outs = {int(i): _prmt(regs[r], m, int(sel, 16)) for i, r, sel in found}
    assert sorted(outs) == list(range(8))
    for i in range(8):  # the interpreter branch: ((w >> 4 i) & 15) << 19 | 0x40000000, i.e. the float 2 + q / 8
        want = (((words >> np.uint32(4 * i)) & np.uint32(15)) << np.uint32(19)) | np.uint32(0x40000000)
        assert np.array_equal(outs[i], want), i
        q = (words >> np.uint32(4 * i)) & np.uint32(15)
        assert np.array_equal(outs[i].view(np.float32), (2 + q / 8).astype(np.float32))


def test_int8_permutes_give_the_interpreter_branch_numbers():
    from polyfuse.backends.triton.quant import gemv_int8_fp8

    asm = _asm_of(gemv_int8_fp8._int8_to_f32.fn)
    words = np.random.default_rng(1).integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    v = words ^ np.uint32(int(re.search(r"xor\.b32 v, \$4, (0x[0-9A-Fa-f]+);", asm).group(1), 16))
    m = np.full_like(words, int(re.search(r"mov\.b32 m, (0x[0-9A-Fa-f]+);", asm).group(1), 16))
    outs = {
        int(i): _prmt(v, m, int(sel, 16)) for i, sel in re.findall(r"prmt\.b32 \$(\d), v, m, (0x[0-9A-Fa-f]+);", asm)
    }
    assert sorted(outs) == [0, 1, 2, 3]
    for i in range(4):  # byte i of the packed word, as int8: its float is the bit-cast minus 2^23 + 128
        q = ((words >> np.uint32(8 * i)) & np.uint32(0xFF)).astype(np.uint8).view(np.int8).astype(np.float32)
        assert np.array_equal(outs[i].view(np.float32) - np.float32(8388736.0), q), i


def _emulate_plane_asm(asm: str, a: np.ndarray, b: np.ndarray) -> dict:
    """Run gemm_int4_mma's plane PTX (prmt, shl / shr, lop3 with the (x & y) | z table 0xEA) on word pairs (a, b)."""
    regs = {}
    outs = {}
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if m := re.fullmatch(r"prmt\.b32 (\w+), \$8, \$9, (0x[0-9A-Fa-f]+)", line):
            regs[m.group(1)] = _prmt(a, b, int(m.group(2), 16))
        elif m := re.fullmatch(r"(shl\.b32|shr\.u32) (\w+), (\w+), (\d+)", line):
            v, n = regs[m.group(3)], np.uint32(int(m.group(4)))
            regs[m.group(2)] = (v << n) if m.group(1).startswith("shl") else (v >> n)
        elif m := re.fullmatch(r"lop3\.b32 \$(\d), (\w+), (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+), 0xEA", line):
            outs[int(m.group(1))] = (regs[m.group(2)] & np.uint32(int(m.group(3), 16))) | np.uint32(
                int(m.group(4), 16)
            )
        elif line and not line.startswith((".reg", "{", "}")):
            raise AssertionError(f"instruction the emulation does not know: {line}")
    return outs


@pytest.mark.parametrize("fp16", [False, True], ids=["bf16", "fp16"])
def test_int4_mma_planes_give_one_plus_nibble_over_16(fp16):
    """Plane i of a word pair (the two words one 32-bit operand register holds) is 1 + (nibble i) / 16 of each word
    in its half, exactly (bf16 or fp16), as the interpreter branch computes it."""
    from polyfuse.backends.triton.quant import gemm_int4_mma

    asm = (gemm_int4_mma._PLANES_FP16 if fp16 else gemm_int4_mma._PLANES_BF16).value
    rng = np.random.default_rng(2)
    a, b = (rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    a[:2], b[:2] = [0, 0xFFFFFFFF], [0xFFFFFFFF, 0x12345678]
    outs = _emulate_plane_asm(asm, a, b)
    assert sorted(outs) == list(range(8))

    def value(bits16):  # fp16 through numpy; bf16 is the top half of a float32
        if fp16:
            return bits16.astype(np.uint16).view(np.float16).astype(np.float32)
        return (bits16 << np.uint32(16)).view(np.float32)

    for i in range(8):
        lo, hi = value(outs[i] & np.uint32(0xFFFF)), value(outs[i] >> np.uint32(16))
        for got, w in ((lo, a), (hi, b)):
            q = ((w >> np.uint32(4 * i)) & np.uint32(15)).astype(np.float32)
            assert np.array_equal(got, 1 + q / 16), i


def _dp4a(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """PTX dp4a.u32.s32: c + sum over the 4 bytes of a (unsigned) times those of b (signed), in int64 here."""
    out = c.astype(np.int64)
    for i in range(4):
        ua = ((a >> np.uint32(8 * i)) & np.uint32(0xFF)).astype(np.int64)
        sb = ((b >> np.uint32(8 * i)) & np.uint32(0xFF)).astype(np.uint8).view(np.int8).astype(np.int64)
        out += ua * sb
    return out


def test_int4_a8_dot_gives_sixteen_times_the_block_dot_product():
    """gemv_int4_a8's PTX for a block of 32 (per word two in-place masks and two dp4a chains, then one
    multiply-add) emulated line by line on random words and activation bytes: 16 sum_i q_i x_i over the block's 32
    weights (q_i nibble i % 8 of word i // 8; x_i the int8 activations, even ones in xe and odd ones in xo), the
    number its interpreter branch computes."""
    from polyfuse.backends.triton.quant import gemv_int4_a8

    rng = np.random.default_rng(3)
    words = [rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32) for _ in range(12)]
    for j in range(12):  # extremes: weights all 15 / all 0, activation bytes all -128 / all 127
        words[j][:2] = [0xFFFFFFFF, 0] if j < 4 else [0x80808080, 0x7F7F7F7F]
    regs = {f"${j + 1}": w for j, w in enumerate(words)}
    zero = np.zeros(4096, np.int64)
    for line in gemv_int4_a8._DOT32.value.splitlines():
        line = line.strip().rstrip(";")
        if m := re.fullmatch(r"and\.b32 (\w+), (\$\d+), (0x[0-9A-Fa-f]+)", line):
            regs[m.group(1)] = regs[m.group(2)] & np.uint32(int(m.group(3), 16))
        elif m := re.fullmatch(r"dp4a\.u32\.s32 (\w+), (\w+), (\$\d+), (\w+)", line):
            regs[m.group(1)] = _dp4a(
                regs[m.group(2)], regs[m.group(3)], zero if m.group(4) == "0" else regs[m.group(4)]
            )
        elif m := re.fullmatch(r"mad\.lo\.s32 \$0, (\w+), 16, (\w+)", line):
            regs["$0"] = regs[m.group(1)] * 16 + regs[m.group(2)]
        elif line and not line.startswith((".reg", "{", "}")):
            raise AssertionError(f"instruction the emulation does not know: {line}")
    want = np.zeros(4096, np.int64)
    for j in range(4):
        w, xe, xo = words[j], words[4 + j], words[8 + j]
        for i in range(8):
            q = ((w >> np.uint32(4 * i)) & np.uint32(15)).astype(np.int64)
            x = xe if i % 2 == 0 else xo
            byte = ((x >> np.uint32(8 * (i // 2))) & np.uint32(0xFF)).astype(np.uint8).view(np.int8)
            want += q * byte.astype(np.int64)
    assert np.array_equal(regs["$0"], 16 * want)
    assert np.abs(16 * want).max() < 2**31  # the int32 result cannot overflow
