"""Intel Gaudi backend (the ``hpu`` entry point): Habana fused kernels and HPU graphs for device ``hpu``.

Importing this package does not import ``habana_frameworks``; probes and kernels import it lazily (see ``_habana``).
"""
