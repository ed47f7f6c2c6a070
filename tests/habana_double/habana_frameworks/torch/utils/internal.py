"""TEST DOUBLE of ``habana_frameworks.torch.utils.internal``: ``is_lazy()``, as in Habana's bridge.

The real function reads ``PT_HPU_LAZY_MODE`` once per process and caches the answer; since Synapse 1.21 an unset
variable means eager mode (``os.getenv("PT_HPU_LAZY_MODE", "0") != "0"``; 1.19 defaulted to "1"). The bridge calls it
at import time to pick its library, so the mode cannot change afterwards. Tests that switch modes in one process call
:func:`_reset_for_tests` after setting the variable (the real bridge has no such thing).
"""

import os


def is_lazy():
    if is_lazy._is_lazy is None:
        is_lazy._is_lazy = os.getenv("PT_HPU_LAZY_MODE", "0") != "0"
    return is_lazy._is_lazy


is_lazy._is_lazy = None


def _reset_for_tests():
    is_lazy._is_lazy = None
