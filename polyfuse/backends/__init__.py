"""Backends: plugins that register implementations of the ops in ``polyfuse.ops`` (and device runtimes) with
``polyfuse.core``. Each is found through the entry-point group ``polyfuse.backends`` (``polyfuse.core.plugins``),
exactly like a third-party backend; nothing in polyfuse imports a backend by name.

* ``triton``: portable Triton kernels (NVIDIA and ROCm GPUs);
* ``cuda``: what is NVIDIA-only: SDPA choices, CUDA graphs and the CUDA runtime, per-GPU tuned GEMV tables;
* ``hpu``: Intel Gaudi through Habana's ``habana_frameworks`` (FusedSDPA, FusedRMSNorm, fused RoPE, HPU graphs).
"""
