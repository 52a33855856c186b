"""Attention over paged KV (PyTorch reference for CPU, Triton for GPU), sampling, fused ops."""
