"""polyfuse: one Llama code base, fused ops chosen per device by a registry."""
