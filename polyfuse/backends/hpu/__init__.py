"""Intel Gaudi backend: Habana fused kernels and HPU graphs (registered for device ``hpu``).

Importing this package does not import ``habana_frameworks``; probes and kernels import it lazily (see ``_habana``).
"""

from polyfuse.backends.hpu import register  # noqa: F401  (registers the implementations and HpuRuntime)
