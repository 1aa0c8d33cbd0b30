"""Measurement: memory (CUDA allocator, NVML, live-tensor tracker, RSS) and step timing."""
