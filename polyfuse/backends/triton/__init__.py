"""Portable Triton kernels, one op per file with its forward and backward (quantized weights' kernels in quant/): they
run wherever Triton targets (NVIDIA and ROCm GPUs; on the CPU under ``TRITON_INTERPRET=1`` for tests).

Tuned for one GPU, the NVIDIA H200, and only as data (configs/, read by tuned.py): the one-row bf16 GEMV's shapes and
tiles (configs/gemv/NVIDIA_H200.json: it runs on the H200 only, any other GPU keeps cuBLAS for those projections),
and the quantized GEMVs' and GEMMs' tiles (configs/qgemv, configs/qgemm: default.json, swept on the H200 and used on
every GPU that has no file of its own, since any tile gives the same numbers). The launch-side constants elsewhere
(rows per program, warps) were also measured on the H200 and apply everywhere."""
