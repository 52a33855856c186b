"""Prometheus metrics of the KV tiers below the device cache, read when Prometheus scrapes.

The worker hands in a function returning each tier's counters as plain dicts (``KVTiers.snapshot``
in workers/engine/kv_tiers.py: ``tier`` host, disk or shared, and its numbers); this module renders them.
Every series has the label ``tier``:

``mqinfer_kv_tier_hits_total``               counter  blocks served (copied up into the KV cache)
``mqinfer_kv_tier_misses_total``             counter  blocks looked up and not held
``mqinfer_kv_tier_rejected_blocks_total``    counter  blocks found and refused, by ``reason``:
                                                      torn, corrupt, foreign (another model or
                                                      settings), tokens (a hash collision)
``mqinfer_kv_tier_prefix_tokens_total``      counter  prompt tokens served
``mqinfer_kv_tier_read_bytes_total``         counter  bytes of blobs read for hits
``mqinfer_kv_tier_written_bytes_total``      counter  bytes of blobs written
``mqinfer_kv_tier_read_seconds_total``       counter  seconds reading and checking hits
``mqinfer_kv_tier_write_seconds_total``      counter  seconds encoding and writing blocks
``mqinfer_kv_tier_evicted_blocks_total``     counter  blocks removed to stay within the size limit
``mqinfer_kv_tier_write_errors_total``       counter  failed writes (a full disk)
``mqinfer_kv_tier_dropped_writes_total``     counter  blocks not written because the writer was
                                                      behind (no ``tier`` label)
``mqinfer_kv_tier_stored_bytes``             gauge    bytes held now
``mqinfer_kv_tier_stored_blocks``            gauge    blocks held now
``mqinfer_kv_tier_capacity_bytes``           gauge    the size limit
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

_COUNTERS = (
    ("hits", "hits", "Blocks served from the tier (copied up into the KV cache)."),
    ("misses", "misses", "Blocks looked up in the tier and not held there."),
    ("prefix_tokens", "prefix_tokens", "Prompt tokens whose KV the tier served."),
    ("read_bytes", "read_bytes", "Bytes of blocks read from the tier for hits."),
    ("written_bytes", "written_bytes", "Bytes of blocks written to the tier."),
    ("read_seconds", "read_seconds", "Seconds spent reading and checking the tier's hits."),
    ("write_seconds", "write_seconds", "Seconds spent encoding and writing blocks to the tier."),
    ("evicted", "evicted_blocks", "Blocks removed from the tier to stay within its size limit."),
    ("write_errors", "write_errors", "Writes to the tier that failed (a full disk); the block is not kept."),
)
_GAUGES = (
    ("stored_bytes", "stored_bytes", "Bytes the tier holds."),
    ("stored_blocks", "stored_blocks", "Blocks the tier holds."),
    ("max_bytes", "capacity_bytes", "The tier's size limit in bytes."),
)


class KVTierCollector:
    def __init__(self, snapshot: Callable[[], list[dict]]) -> None:
        self.snapshot = snapshot

    def collect(self):
        try:
            tiers = self.snapshot()
        except Exception:  # a scrape must not fail the worker
            log.exception("KV tier metrics")
            return
        for key, name, help_text in _COUNTERS:
            family = CounterMetricFamily(f"mqinfer_kv_tier_{name}", help_text, labels=["tier"])
            for t in tiers:
                family.add_metric([t["tier"]], t[key])
            yield family
        rejected = CounterMetricFamily("mqinfer_kv_tier_rejected_blocks", "Blocks found in the tier and refused "
                                       "(never used): torn, corrupt, foreign (another model or settings), tokens "
                                       "(a hash collision).", labels=["tier", "reason"])
        for t in tiers:
            for reason in ("torn", "corrupt", "foreign", "tokens"):
                rejected.add_metric([t["tier"], reason], t["rejected"].get(reason, 0))
        yield rejected
        for key, name, help_text in _GAUGES:
            family = GaugeMetricFamily(f"mqinfer_kv_tier_{name}", help_text, labels=["tier"])
            for t in tiers:
                family.add_metric([t["tier"]], t[key])
            yield family
        dropped = sum(t.get("dropped_writes", 0) for t in tiers)
        yield CounterMetricFamily("mqinfer_kv_tier_dropped_writes", "Blocks not written below the host tier "
                                  "because the background writer was behind.", value=dropped)


__all__ = ["KVTierCollector"]
