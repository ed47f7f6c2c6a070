"""Small helpers shared by the Triton kernels: row views and the (cached) multiprocessor count."""

import functools

import torch


def rows(t: torch.Tensor, h: int = None) -> torch.Tensor:
    """[..., H] -> [N, H] with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1] if h is None else h)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a GPU (asked once per device); 2 under the CPU interpreter."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
