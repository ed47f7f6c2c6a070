"""fp8_block weights on the fp8 tensor cores for many rows (prefill): the activations quantized to e4m3 per token and
128 columns by the per-row quantizing kernel (fp8_scaled_mm.py, each 128-column group taken as a row), then
``torch._scaled_mm`` with 1 x 128 block scales on both operands (cuBLAS's block scaling for fp8, sm90): the
DeepSeek-V3 / Qwen3-FP8 recipe, for which their 128 x 128 block checkpoints were made (their block scales load into
fp8_block's 1 x 128 rows exactly).

W8A8 like fp8's row-wise prefill; the group scales keep an outlier channel from coarsening the whole token. On the
H200 (2048 x 4096 x 6144 / 28672 and 2048 x 14336 x 4096): 104 / 468 / 236 us against row-wise per-channel
fp8's 79 / 359 / 179 and bf16's 133 / 625 / 310, error 2.2-2.4% of the outputs' rms (row-wise 2.3-2.5%).

Takes bfloat16 rows from two on (one row is the GEMV's, gemv_q.py): batch decode too, where it beats
dequantizing the weight per call (H200: 2..64 rows of 14336 x 4096 in 25-29 us against 83-86 for
dequant_mm, 6144 x 4096 in 13-15 against 37-38); K a multiple of 128 and N of 16; GPUs of compute capability 9.0
(cuBLAS's block-scaled fp8 is Hopper's; the probe says so elsewhere). The rest goes to dequant_mm.py. Rows are
padded to a multiple of PAD_ROWS: cuBLAS refused row counts that are not (65, 66, 129, 130, 2047 on the H200; 68, 72,
132, 2048 ran). Against the same arithmetic in float32 the product is within 0.17% of the outputs' rms (the bf16
output's rounding); against the weight-only product 2.0%.
"""

from typing import Optional

import torch

from polyfuse.backends.triton._util import rows
from polyfuse.backends.triton.quant.fp8_scaled_mm import quantize_rows
from polyfuse.ops.quant_formats import FP8_BLOCK


PAD_ROWS = 4


def quantize_groups(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 [M, K], float32 scales [M, K / 128] with stride (1, M)): each 128
    columns of a row scaled to 448 as quantize_rows scales a row (the same bytes as that arithmetic per group)."""
    m, k = x2.shape
    q, s = quantize_rows(x2.contiguous().view(m * (k // FP8_BLOCK), FP8_BLOCK))
    return q.view(m, k), s.view(m, k // FP8_BLOCK).t().contiguous().t()


def accepts_linear_q(x, qweight, bias=None) -> Optional[str]:
    if qweight.format != "fp8_block":
        return f"{qweight.format} weights (takes fp8_block)"
    if x.dtype != torch.bfloat16:
        return "block-scaled fp8 needs bfloat16 activations"
    n, k = qweight.shape
    if k % FP8_BLOCK or n % 16 or x.shape[-1] != k:
        return "K must be a multiple of 128 and N of 16"
    if torch.is_grad_enabled() and x.requires_grad:
        return "needs gradients"
    if not x.is_cuda:
        return "cuBLAS block-scaled fp8: a CUDA GPU"
    return None


def linear_q(x, qweight, bias=None):
    n, k = qweight.shape
    x2 = rows(x, k)
    m = x2.shape[0]
    pad = -m % PAD_ROWS
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
    xq, scale_a = quantize_groups(x2)
    scale_b = qweight.scales.t().contiguous()  # [K / 128, N]: the layout cuBLAS reads for the weight's 1 x 128 blocks
    y = torch._scaled_mm(xq, qweight.qweight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)
    y = y[:m] if pad else y
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)
