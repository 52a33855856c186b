"""Synthetic workloads, the load generator and benchmarks against peers."""

if __name__ == "loadgen":  # imported under its bare name from a checkout: see mqinfer._checkout
    from mqinfer._checkout import defer_to_installed

    defer_to_installed(__name__)
