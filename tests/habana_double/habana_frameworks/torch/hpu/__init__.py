"""TEST DOUBLE of ``habana_frameworks.torch.hpu``: graphs, sync and memory statistics, recorded, on the CPU.

As in the real bridge, the HPU-graph API (``wrap_in_hpu_graph``, ``input_hash``, ... from ``.graphs``) is only
exported in lazy mode: ``if is_lazy(): from .graphs import *``. In eager mode ``wrap_in_hpu_graph`` is absent.
"""

from habana_frameworks import record
from habana_frameworks.torch.utils.internal import is_lazy


GB = 1024**3
DEFAULT_MEMORY = {"InUse": int(1.5 * GB), "MaxInUse": int(2.345 * GB), "Limit": int(94.62 * GB), "NumAllocs": 7}
MEMORY = dict(DEFAULT_MEMORY)


def is_available():
    return True


def device_count():
    return 1


def synchronize():
    record("synchronize")


def memory_stats(device=None):
    record("memory_stats", device)
    return dict(MEMORY)


def reset_peak_memory_stats():
    record("reset_peak_memory_stats")
    MEMORY["MaxInUse"] = MEMORY["InUse"]


if is_lazy():
    from habana_frameworks.torch.hpu.graphs import input_hash, wrap_in_hpu_graph  # noqa: F401
