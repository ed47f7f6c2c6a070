"""Building, loading and saving a model: config -> modules on the meta device -> storage -> weights copied in from a
checkpoint (polyfuse.checkpoint), packed where the run asks (polyfuse.quant) -> kernels resolved by the registry."""
