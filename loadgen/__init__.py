"""Synthetic workloads, the load generator and benchmarks against peers."""
