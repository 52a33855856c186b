"""Fixtures of the load generator's tests."""

from __future__ import annotations

import pytest

from mqinfer.loadgen import bench_roofs


@pytest.fixture(autouse=True)
def small_copy_arrays(monkeypatch):
    """The benches measure the memory roof's bandwidth by copying arrays four times the last-level
    cache (up to 1 GiB each, before and after a run): tens of seconds of memory traffic per run on
    a VM that reports a large shared cache. What these tests check (the roofs computed from the
    measurements and each system's share of them, in the reports and the printouts) is the same
    for any array size, so the benches run in this process copy 16 MiB arrays; the size rule and
    the measurement themselves are checked in test_bench_roofs.py."""
    monkeypatch.setattr(bench_roofs, "copy_array_bytes", lambda cache_bytes: 16 << 20)
