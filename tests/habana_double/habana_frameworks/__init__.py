"""TEST DOUBLE of ``habana_frameworks`` (Intel Gaudi's PyTorch bridge). Not Habana software.

Mirrors the entry points polyfuse's HPU backend calls, validates their arguments the way the backend's contract
with the real kernels requires, computes reference math on the CPU and records every call in ``CALLS`` as
``(name, args, kwargs)``. Tests put the parent folder on ``sys.path`` through a fixture, never globally.
"""

TEST_DOUBLE = True

CALLS: list = []


def record(name, *args, **kwargs):
    """Into ``CALLS``; not while torch.compile traces (a compiled graph runs no Python, so no call is recorded)."""
    import torch

    if torch.compiler.is_compiling():
        return
    CALLS.append((name, args, kwargs))


def on_hpu(kernel, *tensors, dtypes=None):
    """A Habana kernel's inputs must be HPU tensors (of ``dtypes`` when given): what a Gaudi's kernel is handed."""
    import torch

    for t in tensors:
        if torch.is_tensor(t) and t.device.type != "hpu":
            raise RuntimeError(f"{kernel} (test double): expects HPU tensors, got one on {t.device.type} "
                               f"{tuple(t.shape)}")  # fmt: skip
        if torch.is_tensor(t) and dtypes is not None and t.dtype not in dtypes:
            raise RuntimeError(f"{kernel} (test double): dtype {t.dtype} unsupported (takes {dtypes})")


def calls(name):
    """Recorded (args, kwargs) of every call to ``name``."""
    return [(a, k) for n, a, k in CALLS if n == name]


def reset():
    """Forget the calls, the memory statistics and the device's compiled graphs and host reads."""
    import sys

    CALLS.clear()
    hpu = sys.modules.get("habana_frameworks.torch.hpu")  # not imported here: importing the bridge is under test
    if hpu is not None:
        hpu.MEMORY.update(hpu.DEFAULT_MEMORY)
    device = sys.modules.get("habana_frameworks.torch._device")
    if device is not None:
        device.reset()


def shutdown():
    """Stop being a device (tests call it before they drop the double from sys.modules): torch.hpu and the modes
    that route HPU tensors go. HPU tensors made before are dead after this."""
    import sys

    device = sys.modules.get("habana_frameworks.torch._device")
    if device is not None:
        device.disable()
