"""Intel Gaudi backend: Habana fused kernels and HPU graphs (registered for device ``hpu``)."""
