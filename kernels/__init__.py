"""Attention over paged KV (PyTorch reference for CPU, Triton for GPU), sampling, fused ops."""

from mqinfer._checkout import defer_if_bare  # README.md, "Where the code lives"

defer_if_bare(__name__)
