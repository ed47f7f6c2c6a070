"""Everything that makes packed weights: load-time quantization (round to nearest, GPTQ), norm and scale tuning,
quantized checkpoints (AutoGPTQ, compressed-tensors fp8, polyfuse's own), the modules that hold packed weights and the
report. The formats' layouts and native references are ops (polyfuse/ops/quant_formats.py), which kernels read."""
