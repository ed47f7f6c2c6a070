"""TEST DOUBLE of ``habana_frameworks.torch.hpex.kernels``: FusedSDPA and RotaryPosEmbeddingHelperV2.

Both take positional arguments only, in the order optimum-habana passes them, check types, shapes and modes, and
compute reference math on the CPU (differentiable through autograd). Every call is recorded.
"""

import math

import torch

from habana_frameworks import on_hpu, record


SOFTMAX_MODES = {"None", "fast"}
PADDING_SIDES = {"None", "left", "right"}


def _check(cond, msg):
    if not cond:
        raise ValueError("FusedSDPA (test double): " + msg)


class FusedSDPA:
    """``apply(q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode,
    valid_sequence_lengths, padding_side)``, the 11 positional arguments optimum-habana passes.

    Shapes as optimum-habana's Llama passes them (modeling_llama.py, ``pre_attn_forward``): q [B, Hq, Lq, D], k/v
    [B, Hkv, Lk, D] *unrepeated*, Hq a multiple of Hkv. The real kernel (hpex/kernels/FusedSDPA.py, ``is_gqa`` /
    ``gqa_input_reshape_fwd``) treats Hkv not in (Hq, 1) as grouped-query attention and reshapes q to
    [B, Hkv, Hq/Hkv, Lq, D], k/v to [B, Hkv, 1, Lk, D] and a mask to [B, 1, 1, Lq, Lk] (head dim 1) or
    [B, Hkv, Hq/Hkv, Lq, Lk] (head dim Hq); any other mask head count cannot be reshaped.

    Asserts of the real kernel that the double enforces (``requires_backward`` = q, k or v requires grad):
    ``valid_sequence_lengths`` only with ``is_causal``, no mask and no backward ("supported only in inference with
    is_causal(triangular) mask case"); ``softmax_mode="fast"`` with recompute and backward only when causal."""

    @staticmethod
    def apply(*args, **kwargs):
        _check(not kwargs, f"keyword arguments are not accepted here, got {sorted(kwargs)}")
        _check(len(args) == 11, f"expects 11 positional arguments, got {len(args)}")
        record("FusedSDPA", *args)
        q, k, v, mask, dropout_p, is_causal, scale, softmax_mode, recompute, lengths, padding_side = args
        on_hpu("FusedSDPA", q, k, v, mask, lengths)
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check(torch.is_tensor(t) and t.dim() == 4, f"{name} must be a 4-D tensor [B, H, L, D]")
        _check(q.dtype == k.dtype == v.dtype, f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
        _check(k.shape == v.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        b, h, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        _check(k.shape[0] == b and k.shape[3] == d, f"k {tuple(k.shape)} vs q {tuple(q.shape)}")
        _check(hkv >= 1 and h % hkv == 0, f"q heads {h} must be a multiple of k/v heads {hkv}")
        requires_backward = q.requires_grad or k.requires_grad or v.requires_grad
        _check(isinstance(dropout_p, float) and dropout_p == 0.0, f"dropout_p must be 0.0 here, got {dropout_p!r}")
        _check(isinstance(is_causal, bool), f"is_causal must be a bool, got {is_causal!r}")
        _check(scale is None or isinstance(scale, float), f"scale must be None or a float, got {scale!r}")
        _check(softmax_mode in SOFTMAX_MODES, f"softmax_mode must be one of {sorted(SOFTMAX_MODES)}: {softmax_mode!r}")
        _check(isinstance(recompute, bool), f"recompute_mode must be a bool, got {recompute!r}")
        _check(padding_side in PADDING_SIDES, f"padding_side must be one of {sorted(PADDING_SIDES)}: {padding_side!r}")
        _check(not (is_causal and mask is not None), "is_causal=True and attn_mask are exclusive")
        _check(not is_causal or lq == lk, f"is_causal with Lq={lq} != Lk={lk} is not modelled")
        if mask is not None:
            _check(torch.is_tensor(mask) and mask.dim() == 4, "attn_mask must be a 4-D tensor")
            _check(mask.dtype in (torch.bool, q.dtype), f"attn_mask dtype {mask.dtype} is neither bool nor {q.dtype}")
            # one size at a time: under torch.compile they may be symbolic, which tuple membership mishandles
            mb, mh, mq, mk = mask.shape
            _check((mb == 1 or mb == b) and (mh == 1 or mh == h), f"attn_mask {tuple(mask.shape)} vs B/Hq")
            _check((mq == lq or mq == 1) and mk == lk, f"attn_mask {tuple(mask.shape)} vs Lq/Lk")
        if recompute and requires_backward and softmax_mode == "fast":
            _check(is_causal, "softmax_mode='fast' in recompute training mode needs is_causal=True (real assert)")
        if lengths is not None:
            _check(is_causal, "valid_sequence_lengths needs is_causal=True")
            _check(not requires_backward, "valid_sequence_lengths is supported only in inference (real assert)")
            _check(torch.is_tensor(lengths) and lengths.dtype == torch.int32, "valid_sequence_lengths must be int32")
            _check(tuple(lengths.shape) == (b,), f"valid_sequence_lengths must be [B]={b}, got {tuple(lengths.shape)}")
            _check(padding_side in ("left", "right"), "valid_sequence_lengths needs padding_side 'left' or 'right'")

        if hkv != h:  # the kernel's grouped-query path; the math is the same as repeating k/v per group
            k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)
        s = torch.matmul(q.float(), k.float().transpose(2, 3)) * (scale if scale is not None else 1 / math.sqrt(d))
        neg = torch.finfo(q.dtype).min  # finite in q's dtype too, so fully masked (padding) rows stay finite
        drop = torch.zeros((1, 1, lq, lk), dtype=torch.bool, device=q.device)
        if is_causal:
            drop = drop | torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1)
        if lengths is not None:
            pos = torch.arange(lk, device=q.device)[None, :]
            n = lengths.long()[:, None]
            pad = pos < (lk - n) if padding_side == "left" else pos >= n
            drop = drop | pad[:, None, None, :]
        if mask is not None:
            if mask.dtype == torch.bool:
                drop = drop | ~mask
            else:
                s = s + mask.float()
        s = s.masked_fill(drop, neg)
        if softmax_mode == "fast":
            p = torch.softmax(s.to(q.dtype), dim=-1)  # lower-precision softmax, the point of the fast mode
        else:
            p = torch.softmax(s, dim=-1)
        return torch.matmul(p.to(q.dtype).float(), v.float()).to(q.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _match_data_types(p, cos, sin):
    # Habana's rule: any fp32 operand promotes all three to fp32; otherwise cos/sin follow p.
    if torch.float32 in (p.dtype, cos.dtype, sin.dtype):
        return p.float(), cos.float(), sin.float()
    return p, cos.to(p.dtype), sin.to(p.dtype)


class RotaryPosEmbeddingHelperV2:
    """``apply(p, cos, sin, position_ids)``, BLOCKWISE (rotate-half) mode; p [B, H, L, D].

    With position_ids [B, L] (int64/int32), cos/sin are [1, 1, S, D] tables indexed per position, as
    optimum-habana's ``apply_customized_rope_module`` passes them; without, cos/sin must broadcast against p."""

    @staticmethod
    def apply(*args, **kwargs):
        if kwargs or len(args) != 4:
            raise ValueError("RotaryPosEmbeddingHelperV2 (test double): expects (p, cos, sin, position_ids)")
        record("RotaryPosEmbeddingHelperV2", *args)
        p, cos, sin, position_ids = args
        on_hpu("RotaryPosEmbeddingHelperV2", p, cos, sin, position_ids)
        if not (torch.is_tensor(p) and p.dim() == 4):
            raise ValueError("RotaryPosEmbeddingHelperV2 (test double): p must be [B, H, L, D]")
        if cos.shape != sin.shape or cos.shape[-1] != p.shape[-1]:
            raise ValueError(f"RotaryPosEmbeddingHelperV2 (test double): cos {tuple(cos.shape)} vs p {tuple(p.shape)}")
        if position_ids is not None:
            if cos.dim() != 4 or cos.shape[:2] != (1, 1):
                raise ValueError("RotaryPosEmbeddingHelperV2 (test double): with position_ids cos must be [1,1,S,D]")
            if position_ids.dtype not in (torch.int64, torch.int32) or tuple(position_ids.shape) != (
                p.shape[0],
                p.shape[2],
            ):
                raise ValueError("RotaryPosEmbeddingHelperV2 (test double): position_ids must be integer [B, L]")
            # a host read: checked when the call runs eagerly, not inside a traced torch.compile graph
            if not torch.compiler.is_compiling() and (int(position_ids.max()) >= cos.shape[2] or
                                                      int(position_ids.min()) < 0):  # fmt: skip
                raise ValueError("RotaryPosEmbeddingHelperV2 (test double): position_ids out of the table")
            cos = cos[0, 0][position_ids.long()].unsqueeze(1)
            sin = sin[0, 0][position_ids.long()].unsqueeze(1)
        p, cos, sin = _match_data_types(p, cos, sin)
        return p * cos + _rotate_half(p) * sin
