"""Synthetic workloads, the load generator and benchmarks against peers."""

from mqinfer._checkout import defer_if_bare  # README.md, "Where the code lives"

defer_if_bare(__name__)
