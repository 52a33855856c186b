"""Attention over paged KV (PyTorch reference for CPU, Triton for GPU), sampling, fused ops."""

if __name__ == "kernels":  # imported under its bare name from a checkout: see mqinfer._checkout
    from mqinfer._checkout import defer_to_installed

    defer_to_installed(__name__)
