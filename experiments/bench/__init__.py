"""Kernel benchmarks: pytest-benchmark files (bench_<op>.py, CPU) and the GPU suite (gpu.py)."""
