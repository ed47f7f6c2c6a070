"""Programmatic dependent launch (PDL, Hopper and later) for the Triton kernels of inference.

A decode step is a chain of short kernels (a Llama-2-70B layer: nine, 8-110 us each), and between two of them the GPU
idles while the next grid is launched and its blocks placed. With PDL a kernel is launched with the "programmatic
stream serialization" attribute: its blocks may be placed while the kernel before it still runs, and each waits
(``griddepcontrol.wait``) until that kernel has finished and its writes are visible, before touching memory. A kernel
then lets its own dependents launch (``griddepcontrol.launch_dependents``) once it has passed its wait, so at most one
grid waits ahead; the norm and SwiGLU kernels before an int4 one-row GEMV (``EARLY``: norm_gemv_q.py, gemv_q.py
``PAIRED``) let it launch first and then wait (``launch_then_wait``), so its early weight loads also overlap the kernel
before them (two grids wait ahead there). Every kernel launched this way waits before its first load of anything a
kernel before it may write and before its first store, so the order of memory effects is the stream's, as without PDL;
the one exception is the one-row GEMVs' weights (``gemv_common.prefetch_tiles``: int4 loads its first weight tiles before
the wait, as neither of the two kernels launched just before a GEMV writes its weights; a weight the launcher has just
copied into dense rows is not loaded early). A kernel launched without the attribute (cuBLAS, torch's) keeps plain
stream order, and a PDL kernel after it waits for it whole.

Where: the kernels that take a ``PDL`` constexpr and call ``wait_prior(PDL)`` first (the one-row GEMVs, but for their
early weight tiles; RMSNorm and add+RMSNorm, rotary + cache write, decode attention, SwiGLU), launched with
``**pdl_options(device)``. That gives PDL on NVIDIA GPUs of compute capability 9.0 or more, under
``torch.inference_mode`` (generation, prefill and decode: what has been measured and checked on an H200; training
launches plainly), with a Triton that has PDL (3.4 and later: ``gdc_wait`` and the ``launch_pdl`` launch option; with
an older one ``wait_prior`` is empty and nothing launches with PDL), not under the CPU interpreter. The kernel option
``pdl=False`` (core/kernel_options.py) turns it off for a run.
"""

import functools

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import INTERPRET
from polyfuse.core.kernel_options import DEFAULT


def _triton_has_pdl() -> bool:
    """Triton's device-side instructions (tl.extra.cuda.gdc_wait / gdc_launch_dependents) and its launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as extra_cuda
    except Exception:  # no NVIDIA backend in this Triton (ROCm builds), or another layout
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return hasattr(extra_cuda, "gdc_wait") and hasattr(extra_cuda, "gdc_launch_dependents") and "launch_pdl" in fields


TRITON_HAS_PDL = _triton_has_pdl()


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    if INTERPRET or not TRITON_HAS_PDL or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl(device: torch.device, options=DEFAULT) -> bool:
    """Whether kernels on ``device`` launch with PDL (in inference mode) in a run with these kernel options."""
    return options.pdl and _supported(device)


def pdl_options(device: torch.device, options=DEFAULT) -> dict:
    """Keyword arguments of a launch: PDL=<bool> for the kernel, launch_pdl=True where it runs."""
    on = torch.is_inference_mode_enabled() and pdl(device, options)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if TRITON_HAS_PDL:

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        """With PDL: wait for the kernel before this one to finish (its writes visible), then let the next launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def launch_then_wait(PDL: tl.constexpr):
        """With PDL: let the next kernel launch first, then wait for the one before. For a small kernel followed by a
        GEMV that loads weights before its own wait (int4, gemv_common.prefetch_tiles): those loads then start while the
        kernel before this one still runs. Memory order is kept: the next kernel still waits for this one whole."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

else:  # Triton before 3.4: the kernels must not even name the instructions (their cache key walks every attribute)

    @triton.jit
    def wait_prior(PDL: tl.constexpr):
        """No PDL in this Triton: nothing to wait for beyond stream order."""
        pass

    @triton.jit
    def launch_then_wait(PDL: tl.constexpr):
        """No PDL in this Triton: nothing to wait for beyond stream order."""
        pass
