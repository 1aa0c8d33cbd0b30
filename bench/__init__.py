"""Benchmark harness for PyTorch memory-saving training techniques."""

__version__ = "0.1.0"
