"""Benchmarks: kernels and whole training steps on every backend side by side, and the machine they ran on."""
