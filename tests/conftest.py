import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs a worker per core: more threads per worker (and per process it starts) only contend.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton kernels run on the CPU through the interpreter; must be set before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU")
    skip_hpu = pytest.mark.skip(reason="needs an Intel Gaudi with habana_frameworks")
    try:
        import habana_frameworks.torch.hpu as hthpu  # noqa: F401

        has_hpu = hthpu.is_available()
    except Exception:
        has_hpu = False
    for item in items:
        # A module may name the parameter ids of its slow cases (SLOW_PARAMS): those run in `make test-all` only.
        if any(part in item.name for part in getattr(item.module, "SLOW_PARAMS", ())):
            item.add_marker(pytest.mark.slow)
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "hpu" in item.keywords and not has_hpu:
            item.add_marker(skip_hpu)
