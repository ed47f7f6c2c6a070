"""TEST DOUBLE of ``habana_frameworks.torch``: importing it makes ``core`` and ``hpu`` available, as the real one."""

from habana_frameworks.torch import core, hpu  # noqa: F401
