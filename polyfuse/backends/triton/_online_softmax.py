"""The online-softmax update the attention kernels share: one tile of scores folded into the running max, sum and
weighted values (fp32), so a program never holds more than one tile of keys."""

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(m_i, l_i, acc, scores, v, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``scores`` [R, N] (masked keys at -inf) and ``v`` [N, D] into (max, sum, acc); returns the new three."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = p
    else:
        pv = p.to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
    return m_new, l_i, acc
