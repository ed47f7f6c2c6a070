"""Programmatic dependent launch (polyfuse/backends/triton/_pdl.py) without a GPU: where the kernels launch with it,
and that every kernel calling ``wait_prior`` still builds its cache key (what Triton does before compiling) with this
Triton, whether it has PDL (3.4 and later) or not (3.3: the instructions must not even be named). The tokens with PDL
on and off are compared on the GPU (tests/test_cuda_model.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyfuse.backends.triton import _pdl


ROOT = Path(__file__).resolve().parent.parent
KERNELS = {
    "gemv": "_gemv_kernel", "quant.gemv_int8_fp8": "_gemv_scaled_kernel", "quant.gemv_int4": "_gemv_gptq_kernel",
    "quant.gemv_gguf": "_gemv_gguf_kernel", "rms_norm": "_rms_norm_fwd_kernel", "rotary_kv_write": "_rotary_kv_write_kernel",
    "decode_attention": "_decode_kernel", "swiglu": "_swiglu_fwd_kernel",
}  # fmt: skip


def test_pdl_launches_only_in_inference_on_hopper_nvidia_gpus(monkeypatch):
    """launch_pdl under torch.inference_mode on NVIDIA GPUs of compute capability 9.0 and up with a Triton that has
    PDL; not in training (grad mode), on older GPUs, ROCm, the CPU, under the interpreter, with an older Triton or in a
    run with the kernel option pdl=False."""
    from polyfuse.core.kernel_options import KernelOptions

    gpu = torch.device("cuda", 0)

    def options(interpret=False, enabled=True, has=True, cap=(9, 0), hip=None, device=gpu, inference=True):
        monkeypatch.setattr(_pdl, "INTERPRET", interpret)
        monkeypatch.setattr(_pdl, "TRITON_HAS_PDL", has)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
        monkeypatch.setattr(torch.version, "hip", hip)
        _pdl._supported.cache_clear()
        try:
            with torch.inference_mode(inference):
                return _pdl.pdl_options(device, KernelOptions(pdl=enabled))
        finally:
            _pdl._supported.cache_clear()

    assert options() == {"PDL": True, "launch_pdl": True}
    assert options(cap=(10, 0)) == {"PDL": True, "launch_pdl": True}
    for off in (dict(inference=False), dict(cap=(8, 9)), dict(interpret=True), dict(enabled=False), dict(has=False),
                dict(hip="6.2"), dict(device=torch.device("cpu"))):  # fmt: skip
        assert options(**off) == {"PDL": False}, off


@pytest.mark.slow
def test_kernels_calling_wait_prior_build_their_cache_key_with_this_triton():
    """Compiled (not interpreted) kernels: Triton walks every attribute a kernel names to build its cache key, so a
    kernel naming an instruction this Triton lacks fails at its first launch on any GPU. The CPU suite interprets the
    kernels, which never builds the key: a subprocess with the interpreter off does."""
    code = (
        "import importlib\n"
        f"for m, k in {KERNELS!r}.items():\n"
        "    fn = getattr(importlib.import_module('polyfuse.backends.triton.' + m), k)\n"
        "    assert len(fn.cache_key) > 8, m\n"
        "from polyfuse.backends.triton import _pdl\n"
        "print('has_pdl', _pdl.TRITON_HAS_PDL)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() in ("has_pdl True", "has_pdl False")
