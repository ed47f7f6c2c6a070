"""Portable Triton kernels, one op per file with its forward and backward: they run wherever Triton targets
(NVIDIA and ROCm GPUs; on the CPU under ``TRITON_INTERPRET=1`` for tests). Nothing here is tuned for one GPU."""
