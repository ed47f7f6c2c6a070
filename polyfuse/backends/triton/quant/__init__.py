"""Quantized-weight kernels of the Triton backend: one-row GEMVs (``gemv_<format>[_a8].py``), few-row GEMMs
(``gemm_<format>[_mma].py``), dequantize kernels (``dequant_<format>.py``), the int8 activation quantizers
(``act_int8.py``) and the implementations the registry calls, named after them (``gemv_q``, ``gemm_q``,
``dequant_mm``, ``fp8_scaled_mm``, ``fp8_block_mm``, ``norm_gemv_q``, ``norm_fp8_scaled_mm``)."""
