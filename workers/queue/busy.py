"""Where a worker's time went: busy time (the loop's working time, less blocking reads), split
into the engine's phases and the rest, and the exit summary a stopping worker leaves beside its
rows (``OUT/.mqinfer/workers/<consumer>.json``) for benchmarks to read."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mqinfer.schemas.dataset import fsync_dir, make_dirs, safe_name
from mqinfer.schemas.dataset_uri import join, out_location, put_object

# Beside the datasets, the folder of run state (`mqinfer run` keeps its manifests there too).
STATE_DIR = ".mqinfer"


def summary_path(out_dir: str | os.PathLike[str], consumer: str) -> Path | str:
    """Where a worker's exit summary goes: a path, or a URI when ``out_dir`` is object storage."""
    return join(out_location(out_dir), STATE_DIR, "workers", f"{safe_name(consumer)}.json")


class BusyTime:
    """The loop's busy seconds (an iteration counts when the worker held work before or after
    it), and the engine phases' seconds passed on to the metrics as they grow."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics
        self.busy_s = 0.0
        self._phases_seen: dict[str, float] = {}

    def add(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.busy_s += seconds
        self.metrics.busy_seconds.inc(seconds)

    def phases(self, phase_seconds: dict[str, float]) -> None:
        """The engine's cumulative seconds by phase, after a step."""
        seen = self._phases_seen
        for phase, total in phase_seconds.items():
            counter = self.metrics.engine_phase_seconds.get(phase)
            if counter is not None and total > seen.get(phase, 0.0):
                counter.inc(total - seen.get(phase, 0.0))
                seen[phase] = total

    def summary(self, phase_seconds: dict[str, float]) -> dict:
        """Where busy time went: the engine's phases and everything else (ingest, sinks, acks,
        replies, keepalive), and the share of busy time outside the model's forward pass."""
        phases = {k: round(v, 4) for k, v in phase_seconds.items()}
        forward = phase_seconds.get("forward", 0.0)
        busy = self.busy_s
        return {"busy_s": round(busy, 4), "phases_s": phases,
                "other_s": round(max(0.0, busy - sum(phase_seconds.values())), 4),
                "outside_forward_share": round(1.0 - forward / busy, 4) if busy > 0 else None}


def write_exit_summary(path: Path | str, summary: dict) -> None:
    """Write ``summary`` as JSON at ``path`` atomically (temp file, fsync, rename; in object
    storage, one upload)."""
    if not isinstance(path, Path):
        put_object(path, (json.dumps(summary, indent=1, sort_keys=True) + "\n").encode())
        return
    make_dirs(path.parent)
    # Not named like a dataset's temp file: a starting worker removes those under the whole folder.
    temp = path.with_name(f".{path.name}.{os.getpid()}.writing")
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    fsync_dir(path.parent)
