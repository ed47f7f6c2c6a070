"""TEST DOUBLE of ``habana_frameworks`` (Intel Gaudi's PyTorch bridge). Not Habana software.

Mirrors the entry points polyfuse's HPU backend calls, validates their arguments the way the backend's contract
with the real kernels requires, computes reference math on the CPU and records every call in ``CALLS`` as
``(name, args, kwargs)``. Tests put the parent folder on ``sys.path`` through a fixture, never globally.
"""

TEST_DOUBLE = True

CALLS: list = []


def record(name, *args, **kwargs):
    CALLS.append((name, args, kwargs))


def calls(name):
    """Recorded (args, kwargs) of every call to ``name``."""
    return [(a, k) for n, a, k in CALLS if n == name]


def reset():
    import sys

    CALLS.clear()
    hpu = sys.modules.get("habana_frameworks.torch.hpu")  # not imported here: importing the bridge is under test
    if hpu is not None:
        hpu.MEMORY.update(hpu.DEFAULT_MEMORY)
