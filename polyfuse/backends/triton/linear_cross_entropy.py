"""Linear layer fused with cross-entropy, in chunks of rows so the [N, V] logits never exist whole.

For each chunk of rows: ``logits = h_chunk @ W.T`` (torch matmul, fp32 accumulation, result in the input dtype as
the native ``hidden @ weight.t()``); a Triton kernel computes each row's loss (online log-sum-exp in fp32) and
overwrites the logits with d loss_row / d logits (softmax - one_hot, zero for ignored rows); then
``grad_hidden[chunk] = dlogits @ W`` and ``grad_W += dlogits.T @ h_chunk`` are accumulated right away (Liger's
trick), so the backward only scales them in place by ``grad_output`` (and ``1 / n_valid`` for ``reduction="mean"``,
applied as a tensor so nothing syncs with the host). grad_W is accumulated in the weight's dtype, as Liger-Kernel
does: each chunk's GEMM sums in fp32 inside cuBLAS and rounds once into the accumulator. An fp32 accumulator for a
128k x 2048 bf16 head is 1 GiB more at the training step's peak (plus its bf16 copy in the backward), which is what
put polyfuse's 1B step above Liger's memory (issue 13); ``fp32_accumulate=True`` keeps the fp32 one (on CUDA one
GEMM with an fp32 output from bf16/fp16 inputs, ``torch.addmm(..., out_dtype=torch.float32)``, where torch has it).
"""

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import cast_rne


@triton.jit
def _ce_rows_kernel(LOGITS, stride_l, LABELS, LOSS, V, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_l
    label = tl.load(LABELS + row).to(tl.int64)
    cols0 = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], -3.0e38, tl.float32)
    s_vec = tl.zeros([BLOCK], dtype=tl.float32)
    xl_vec = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        x = tl.load(ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m_vec, x)
        s_vec = s_vec * tl.exp(m_vec - m_new) + tl.exp(x - m_new)
        m_vec = m_new
        xl_vec += tl.where(cols == label, x, 0.0)
    m = tl.max(m_vec, axis=0)
    lse = m + tl.log(tl.sum(s_vec * tl.exp(m_vec - m), axis=0))
    ignored = label == ignore_index
    loss = tl.where(ignored, 0.0, lse - tl.sum(xl_vec, axis=0))
    tl.store(LOSS + row, loss)
    coef = tl.where(ignored, 0.0, 1.0)
    for start in range(0, V, BLOCK):
        cols = start + cols0
        mask = cols < V
        x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) * coef
        grad = tl.where(cols == label, grad - coef, grad)
        tl.store(ptr + cols, cast_rne(grad, LOGITS.dtype.element_ty), mask=mask)


def chunk_rows(n: int, h: int, v: int, min_rows: int = 1) -> int:
    """Rows per chunk: the chunk's logits (rows x V) hold about as many elements as hidden (N x H), but at least
    ``min_rows`` rows: every chunk re-reads W three times and adds a whole fp32 V x H update into grad_W, so
    small chunks (64 rows for a 128k vocabulary over hidden 2048) made the loss memory-bound on a GPU. The forward
    asks for ``MIN_CHUNK_ROWS`` on GPUs."""
    if n <= 0:
        return 1
    inc_factor = triton.cdiv(v, h)
    return max(1, min(n, max(min_rows, triton.next_power_of_2(triton.cdiv(n, inc_factor)))))


MIN_CHUNK_ROWS = 1024


def _ce_rows(logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor, ignore_index: int) -> None:
    rows, v = logits.shape
    if rows == 0:
        return
    block = min(triton.next_power_of_2(v), 4096 if logits.is_cuda else 1024)
    _ce_rows_kernel[(rows,)](logits, logits.stride(0), labels, loss, v, ignore_index, BLOCK=block, num_warps=8)


_FP32_OUT_GEMM: dict = {}  # device -> whether addmm with out_dtype=float32 (bf16/fp16 in, fp32 out) works there


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b. An accumulator of the inputs' dtype: one GEMM with beta=1. An fp32 one for low-precision inputs:
    one cuBLAS GEMM that reads and writes it (``out_dtype``) where torch has it, instead of a low-precision product,
    an fp32 copy of it and an add (three passes over [V, H] per chunk)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda and _FP32_OUT_GEMM.get(acc.device, True):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _FP32_OUT_GEMM[acc.device] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_GEMM[acc.device] = False
    acc += (a @ b).float()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, chunk, fp32_accumulate):
        if reduction not in ("mean", "sum"):
            raise ValueError(f"linear_cross_entropy: reduction {reduction!r} unsupported (mean or sum)")
        n, h = hidden.shape
        v = weight.shape[0]
        labels = labels.reshape(-1)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        hid = hidden.to(dtype)
        w = weight.to(dtype)
        loss_rows = torch.empty((n,), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty((n, h), dtype=dtype, device=hidden.device) if need_h else None
        acc_dtype = torch.float32 if fp32_accumulate else dtype
        grad_w = torch.zeros((v, h), dtype=acc_dtype, device=weight.device) if need_w else None
        chunk = chunk or chunk_rows(n, h, v, MIN_CHUNK_ROWS if hidden.is_cuda else 1)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            h_c = hid[start:end]
            logits = h_c @ w.t()
            _ce_rows(logits, labels[start:end].contiguous(), loss_rows[start:end], ignore_index)
            if need_h:
                torch.mm(logits, w, out=grad_h[start:end])
            if need_w:
                _accumulate(grad_w, logits.t(), h_c)
        total = loss_rows.sum()
        if reduction == "mean":
            scale = 1.0 / (labels != ignore_index).sum().to(torch.float32)
        else:
            scale = torch.ones((), dtype=torch.float32, device=hidden.device)
        ctx.save_for_backward(grad_h, grad_w, scale)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_h, grad_w, scale = ctx.saved_tensors
        g = grad_output.to(torch.float32) * scale
        # In place: the saved buffers are this graph's own and die with it (a second backward through the same
        # graph, retain_graph=True, is not supported, as in Liger-Kernel).
        dh = grad_h.mul_(g).to(ctx.dtypes[0]) if grad_h is not None else None
        dw = grad_w.mul_(g).to(ctx.dtypes[1]) if grad_w is not None else None
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk: int = 0,
    fp32_accumulate: bool = False,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, labels)`` without holding the [N, V] logits. ``chunk``: rows per chunk
    (0: automatic, see ``chunk_rows``); ``fp32_accumulate``: grad_W in fp32 instead of the weight's dtype."""
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, reduction, chunk, fp32_accumulate)
