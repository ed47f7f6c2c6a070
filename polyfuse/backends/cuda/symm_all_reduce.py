"""All-reduce of decode-sized tensors in one kernel over NVLink peer memory (PyTorch symmetric memory), no NCCL.

Tensor-parallel decode all-reduces a few KB twice per layer (batch 1, Llama-3-8B on 2 GPUs: 8 KB, 64 times a token);
NCCL's ring/tree protocols cost ~10+ us per call there. ``torch.ops.symm_mem.one_shot_all_reduce*`` copies this
rank's input into a buffer every rank mapped at ``rendezvous`` time, meets the others at a barrier held in device
memory, and sums every peer's copy with plain loads: one kernel, graph-capturable (the barrier lives in signal pads,
not on the host). It uses peer loads, not NVLink multicast, so it works with ``NCCL_NVLS_ENABLE=0`` /
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` (set on the lent machines; keep them).

The buffer is allocated and exchanged (a collective: every rank of the group calls it, in the same order) on the
first call per (group, device), which happens in the eager warm-up step before any CUDA-graph capture. Inputs larger
than ``MAX_BYTES`` (prefill, big-batch logits), non-contiguous ones or other dtypes are declined to NCCL.
"""

from __future__ import annotations

from typing import Optional

import torch


MAX_BYTES = 1 << 20  # above it NCCL's bandwidth-optimal algorithms win
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BUFFERS: dict = {}  # (group name, device) -> symmetric uint8 buffer of MAX_BYTES


def unusable() -> Optional[str]:
    """None when this torch has the symmetric-memory one-shot all-reduce, else why not."""
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except Exception as e:  # pragma: no cover - torch built without distributed
        return f"torch has no symmetric memory ({type(e).__name__})"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "one_shot_all_reduce_out"):
        return "torch has no symm_mem.one_shot_all_reduce_out"
    return None


def accepts_all_reduce(x: torch.Tensor, group=None) -> Optional[str]:
    if group is None:
        return "no process group"
    if not x.is_cuda or not x.is_contiguous() or x.dtype not in DTYPES:
        return "needs a contiguous bf16/fp16/fp32 CUDA tensor"
    return size_refusal(x.numel() * x.element_size())


def size_refusal(nbytes: int) -> Optional[str]:
    if nbytes > MAX_BYTES:
        return f"{nbytes} bytes > {MAX_BYTES} (NCCL's bandwidth-optimal algorithms win there)"
    if nbytes % 16:
        return "size not a multiple of 16 bytes (the kernel's vector width)"
    return None


def _buffer(group, device: torch.device) -> torch.Tensor:
    key = (group.group_name, device)
    buf = _BUFFERS.get(key)
    if buf is None:
        from torch.distributed import _symmetric_memory as symm_mem

        buf = symm_mem.empty(MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buf, group.group_name)
        _BUFFERS[key] = buf
    return buf


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over ``group`` in place (the op's contract) and return it."""
    flat = x.view(-1)
    slot = _buffer(group, x.device)[: flat.numel() * flat.element_size()].view(x.dtype)
    name = group.group_name
    copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
    if copy_out is not None:  # the kernel copies the input into the buffer itself
        copy_out(slot, flat, "sum", name, flat)
    else:
        slot.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(slot, "sum", name, flat)
    return x
