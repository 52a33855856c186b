"""Durable Parquet sinks for result and cost rows: the last step before a worker acks.

:class:`Sinks` buffers rows and writes costs before results, so a crash in between leaves an
orphan cost row (compaction marks it ``duplicate``) rather than a result nobody paid for. The
files' layout and the atomic write are in :mod:`mqinfer.schemas.dataset`; ``out_dir`` may also be
object storage (a pyarrow filesystem URI, :mod:`mqinfer.schemas.dataset_uri`), where each part is
made visible by a single upload.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mqinfer.schemas.dataset import COSTS_DIR, RESULTS_DIR, DatasetWriter, partition_for
from mqinfer.schemas.dataset_uri import ObjectDatasetWriter, join, out_location
from mqinfer.schemas.rows import COST_SCHEMA, RESULT_SCHEMA, CostRow, ResultRow, check_row, rows_to_table

class Sinks:
    """The result and cost datasets of one worker, with buffering and a flush policy.

    Rows get cheap checks when added (:func:`check_row`), so a malformed row fails at its
    source instead of failing every later flush. ``pending`` counts buffered rows of both
    datasets; ``should_flush`` says when ``flush_rows`` of them are buffered or the oldest has
    waited ``flush_interval_s``. Safe to use from several threads.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        worker: str,
        *,
        flush_rows: int = 256,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        before_rename: Callable[[Path], None] | None = None,
    ) -> None:
        if flush_rows < 1:
            raise ValueError(f"flush_rows must be at least 1, got {flush_rows}")
        if not flush_interval_s >= 0:
            raise ValueError(f"flush_interval_s must be >= 0, got {flush_interval_s}")
        self.out_dir = out_location(out_dir)
        self.worker = worker
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        self.results = _writer(self.out_dir, RESULTS_DIR, RESULT_SCHEMA, worker, before_rename)
        self.costs = _writer(self.out_dir, COSTS_DIR, COST_SCHEMA, worker, before_rename)
        # (partition, row) in arrival order.
        self._results: list[tuple[str, ResultRow]] = []
        self._costs: list[tuple[str, CostRow]] = []
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()

    def add(self, result: ResultRow, cost: CostRow | None = None) -> None:
        """Buffer a request's result row and its cost row."""
        check_row(result, RESULT_SCHEMA)
        result_item = (partition_for(result.finished_at), result)
        cost_item = None
        if cost is not None:
            check_row(cost, COST_SCHEMA)
            cost_item = (partition_for(cost.finished_at), cost)
        with self._lock:
            self._results.append(result_item)
            if cost_item is not None:
                self._costs.append(cost_item)
            self._touch()

    def add_cost(self, cost: CostRow) -> None:
        """Buffer a cost row that has no result row (``idle``, ``startup``)."""
        check_row(cost, COST_SCHEMA)
        item = (partition_for(cost.finished_at), cost)
        with self._lock:
            self._costs.append(item)
            self._touch()

    def _touch(self) -> None:
        if self._oldest is None:
            self._oldest = self.clock()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._results) + len(self._costs)

    def buffered_device_s(self, worker: str) -> float:
        """Device seconds of the buffered cost rows of ``worker`` (a worker also writes ``lost`` rows
        under the name of a dead one)."""
        with self._lock:
            return sum(row.device_s for _, row in self._costs if row.worker == worker)

    def should_flush(self) -> bool:
        with self._lock:
            if not self._results and not self._costs:
                return False
            if len(self._results) + len(self._costs) >= self.flush_rows:
                return True
            return self._oldest is not None and self.clock() - self._oldest >= self.flush_interval_s

    def flush(self) -> int:
        """Write every buffered row durably, costs first; returns the number of rows written.

        On failure the exception propagates and the rows not yet written stay buffered (rows of
        partitions already published are not written twice).
        """
        with self._flush_lock:
            with self._lock:
                costs, results, oldest = self._costs, self._results, self._oldest
                self._costs, self._results, self._oldest = [], [], None
            written = 0
            try:
                written += _write_items(self.costs, costs)
                written += _write_items(self.results, results)
            except BaseException:
                with self._lock:
                    self._costs = costs + self._costs
                    self._results = results + self._results
                    times = [t for t in (oldest, self._oldest) if t is not None]
                    self._oldest = min(times) if times else None
                raise
            return written


def _writer(out: str | Path, name: str, schema, worker: str, before_rename) -> DatasetWriter | ObjectDatasetWriter:
    """The writer of dataset ``name`` under ``out``: a local folder, or object storage (a URI)."""
    if isinstance(out, Path):
        return DatasetWriter(out / name, schema, worker, before_rename=before_rename)
    return ObjectDatasetWriter(str(join(out, name)), schema, worker)


def _write_items(writer: DatasetWriter | ObjectDatasetWriter, items: list[tuple[str, Any]]) -> int:
    """Publish ``items`` one partition at a time, removing each published group from ``items``."""
    written = 0
    while items:
        partition = items[0][0]
        group = [row for p, row in items if p == partition]
        writer.write_table(partition, rows_to_table(group, writer.schema))
        items[:] = [item for item in items if item[0] != partition]
        written += len(group)
    return written
