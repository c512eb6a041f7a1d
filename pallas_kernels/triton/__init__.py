"""Paged attention for NVIDIA GPUs: Pallas kernels lowered through Triton, and the same algorithm in Triton's
language called through jax-triton."""
