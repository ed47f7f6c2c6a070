"""TEST DOUBLE of ``habana_frameworks.torch.hpu``: graphs, sync, memory statistics, ``random`` and ``metrics``.

As in the real bridge, the HPU-graph API (``wrap_in_hpu_graph``, ``input_hash``, ... from ``.graphs``) is only
exported in lazy mode: ``if is_lazy(): from .graphs import *``. In eager mode ``wrap_in_hpu_graph`` is absent.
"""

from habana_frameworks import record
from habana_frameworks.torch.hpu import metrics, random  # noqa: F401
from habana_frameworks.torch.hpu.random import initial_seed, manual_seed, manual_seed_all  # noqa: F401
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
    from habana_frameworks.torch import _device

    if _device.STATE.lazy:
        _device.mark_step()  # the host waits for the device: what is pending runs


def memory_stats(device=None):
    record("memory_stats", device)
    return dict(MEMORY)


def reset_peak_memory_stats():
    record("reset_peak_memory_stats")
    MEMORY["MaxInUse"] = MEMORY["InUse"]


if is_lazy():
    from habana_frameworks.torch.hpu.graphs import ModuleCacher, input_hash, wrap_in_hpu_graph  # noqa: F401


class Stream:
    """The device's streams (the double has one, synchronous): what torch's device interfaces look up."""

    def __init__(self, device=None, priority=0):
        self.device = device

    def synchronize(self):
        synchronize()

    def wait_stream(self, stream):
        pass


class Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        synchronize()


def current_device():
    return 0


def set_device(device):
    pass


def current_stream(device=None):
    return Stream(device)


def default_stream(device=None):
    return Stream(device)
