"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step is a chain of short kernels (a Llama-2-70B layer: nine, 8-110 us each), and between two of them the GPU
idles while the next grid is launched and its blocks placed. With PDL a kernel is launched with the "programmatic
stream serialization" attribute: its blocks may be placed while the kernel before it still runs, and each waits
(``griddepcontrol.wait``) until that kernel has finished and its writes are visible, before touching memory. A
kernel then lets its own dependents launch (``griddepcontrol.launch_dependents``) once it has passed its wait, so at
most one grid waits ahead. Every kernel launched this way waits before its first load or store, so the order of
memory effects is the stream's, as without PDL; a kernel launched without the attribute (cuBLAS, torch's) keeps
plain stream order, and a PDL kernel after it waits for it whole.

``pdl_options(device)``: the launch options (``launch_pdl=True``) where PDL runs: NVIDIA GPUs of compute capability
9.0 or more, not under the CPU interpreter; ``POLYFUSE_PDL=0`` turns it off. Kernels take a ``PDL`` constexpr and call
``wait_prior(PDL)`` first.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from polyfuse.backends.triton._rounding import INTERPRET


ENABLED = os.environ.get("POLYFUSE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    if INTERPRET or not ENABLED or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL."""
    return _supported(torch.device(device.type, device.index if device.index is not None else 0))


def pdl_options(device: torch.device) -> dict:
    """Keyword arguments of a launch: PDL=<bool> for the kernel, launch_pdl=True where it runs."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """With PDL: wait for the kernel before this one to finish (its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
