"""Benchmark helpers shared by examples/benchmark_*.py: model shapes, bandwidth ceiling, timing."""
