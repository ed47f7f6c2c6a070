"""NVIDIA backend: Triton kernels, SDPA/flash attention and CUDA graphs (registered for device ``cuda``)."""

from polyfuse.backends.cuda import register
