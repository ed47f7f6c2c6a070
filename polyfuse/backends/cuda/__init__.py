"""NVIDIA-only pieces (the ``cuda`` entry point): the CUDA runtime with whole-step CUDA graphs, SDPA's flash and
memory-efficient attention, and the per-GPU tuned tables that route decode projections to the Triton GEMV.
The portable Triton kernels are the ``triton`` backend's."""
