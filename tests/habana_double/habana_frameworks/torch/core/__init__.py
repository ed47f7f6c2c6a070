"""TEST DOUBLE of ``habana_frameworks.torch.core``: ``mark_step()``.

In the real bridge ``mark_step`` is decorated ``@lazy_only``: in eager mode it is a no-op (with a warning). The double
records "mark_step" in lazy mode and "mark_step_in_eager_mode" otherwise, so tests can tell a misplaced call apart.
In lazy mode it runs the ops accumulated since the last one as one graph (``_device.py``: compiled once per
signature).
"""

from habana_frameworks import record
from habana_frameworks.torch.utils.internal import is_lazy


def mark_step(device_str="", sync=False):
    record("mark_step" if is_lazy() else "mark_step_in_eager_mode")
    if is_lazy():
        from habana_frameworks.torch import _device

        _device.mark_step()
