"""TEST DOUBLE of ``habana_frameworks.torch.hpu``: graphs, sync and memory statistics, recorded, on the CPU.

``wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None)``
replaces ``module.forward`` in place and returns the module, like the real one; the wrapper understands the
``bypass_hpu_graphs=True`` keyword (plain forward) and records "hpu_graph_capture" on the first call per input
signature and "hpu_graph_replay" after, "hpu_graph_bypass" when bypassed.
"""

import functools

import torch

from habana_frameworks import record


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


def _signature(obj):
    if torch.is_tensor(obj):
        return ("T", tuple(obj.shape), obj.dtype)
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    return obj


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"wrap_in_hpu_graph expects a torch.nn.Module, got {type(module).__name__}")
    record("wrap_in_hpu_graph", module, max_graphs=max_graphs)
    cache = set()
    orig_fwd = module.forward

    @functools.wraps(orig_fwd)
    def forward(*args, **kwargs):
        if kwargs.pop("bypass_hpu_graphs", False):
            record("hpu_graph_bypass")
            return orig_fwd(*args, **kwargs)
        key = _signature((args, kwargs))
        if key in cache:
            record("hpu_graph_replay")
        else:
            cache.add(key)
            record("hpu_graph_capture")
        return orig_fwd(*args, **kwargs)

    module.forward = forward
    module.clear_cache = cache.clear
    return module
