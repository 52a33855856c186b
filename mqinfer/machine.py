"""The machine's bill for ``mqinfer run``: its cost rows add up to the machine's wall time.

The price is per device-hour, and a run holds its devices from its first worker's start to its
last worker's exit (the *window*). On a CPU the machine is one device; on CUDA the run holds
every device one of its workers runs on. Each worker bills its share of them
(``workers/queue/costs.py``): the run tells every worker its share of the layout
(:func:`worker_shares`), so that its workers together hold at most the whole machine.

What no worker covers is the run's to bill: a core before its worker started (interpreter and
model load are the worker's own ``startup``, but the process does not start at the same instant
as the others), after its worker exited, cores that no worker's threads use, and the time of a
killed worker after its last beat. The run writes that remainder as one ``idle`` cost row under
the worker name ``run``, its ``device_share`` the uncovered share averaged over the window, so
that the cost rows of every kind add up to the window times the devices, and ``cost_usd`` to
that times the price. A killed worker's own time up to its last beat is its ``lost`` row
(``workers/queue/uptime.py``): a surviving worker writes it, or the run does once every worker exited
(:func:`settle_lost`).

The window and its sums are kept in ``OUT/.mqinfer/machine/<job_id>.json`` (``OUT/.mqinfer`` is
the run's state folder), one entry per run of the job, so that the bill can be checked against
the machine's time.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

RUN_WORKER = "run"  # the worker name of the rows the run writes itself
MACHINE_DIR = "machine"


@dataclass
class Window:
    """The devices a run holds and when it held them."""

    devices: float  # priced devices the run holds: 1 for a CPU machine, else its CUDA devices
    price_per_device_hour: float
    started_at: float | None = None  # just before the first worker started
    ended_at: float | None = None  # just after the last worker exited
    pids: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.started_at = time.time()

    def end(self) -> None:
        self.ended_at = time.time()

    def worker_names(self, names: list[str]) -> list[str]:
        """Those of ``names`` that are this run's workers: a worker's default consumer name is
        ``<host>-<pid>-<random>`` (``workers.worker.default_consumer_name``)."""
        prefixes = tuple(f"{socket.gethostname()}-{pid}-" for pid in self.pids)
        return [n for n in names if n.startswith(prefixes)]


def worker_shares(opts: dict, places: list[tuple[str, str | None]], *, cores: int | None = None,
                  cuda_count: int | None = None) -> tuple[list[float | None], float]:
    """(each worker's device share, the devices the run holds) for ``run``'s layout ``opts`` and
    its workers' ``places`` (``(--device, --devices)`` from ``run.placement``).

    On a CPU, a worker holds its ranks' threads over the usable cores; when the workers' threads
    outnumber the cores they share the machine equally, so together they never hold more than the
    one device. On CUDA, a worker holds its ranks' devices, each split between the workers placed
    on it. A share given with ``--device-share`` is the user's (None here: the flag passes on as it
    is)."""
    from mqinfer.layout import ranks_per_worker
    from mqinfer.workers import devices

    ranks = ranks_per_worker(opts)  # tensor x pipeline ranks, a process (and on CUDA a device) each
    count = len(places)
    on_cuda = any(device.startswith("cuda") for device, _ in places)  # placement resolved "auto"
    if on_cuda:
        cuda_count = devices.cuda_device_count() if cuda_count is None else cuda_count
        held = [devices.rank_devices(device, listed, ranks, cuda_count) for device, listed in places]
        users: dict[str, int] = {}
        for mine in held:
            for d in set(mine):
                users[d] = users.get(d, 0) + 1
        shares = [sum(1.0 / users[d] for d in set(mine)) for mine in held]
        capacity = float(len(users))
    else:
        threads = devices.cpu_threads(opts.get("num_threads"), ranks)
        share = min(devices.cpu_device_share(threads, ranks, cores), 1.0 / max(1, count))
        shares, capacity = [share] * count, 1.0
    if opts.get("device_share") is not None:
        return [None] * count, capacity
    return shares, capacity


def settle_lost(client, streams: list[str], group: str, window: Window, out: Path | str) -> int:
    """Once every worker of the run exited: bill the ``lost`` time of those that were killed and
    that no surviving worker billed yet. Returns how many rows were written."""
    import redis

    from mqinfer.schemas import keys
    from mqinfer.schemas.dataset import COSTS_DIR
    from mqinfer.schemas.dataset_uri import dataset_writer
    from mqinfer.schemas.rows import COST_SCHEMA
    from mqinfer.workers.queue.uptime import LostTime

    written = 0
    for stream in streams:
        try:
            consumers = client.xinfo_consumers(keys.request_stream(stream), group)
        except redis.exceptions.RedisError:
            continue
        names = window.worker_names([c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
                                     for c in consumers])
        lost = LostTime(client, stream, group, RUN_WORKER, claim_idle_ms=100)
        rows = lost.claim(names, time.time(), dead_after_s=0.0)
        if rows:
            dataset_writer(out, COSTS_DIR, COST_SCHEMA, RUN_WORKER).write(rows)
            written += len(rows)
        lost.confirm()
    return written


def _covered(out: Path | str, window: Window) -> tuple[float, float, str | None]:
    """(device seconds, cost) of the rows of the run's workers, and their model."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from mqinfer.schemas.dataset import COSTS_DIR, part_files
    from mqinfer.schemas.dataset_uri import dataset_parts
    from mqinfer.schemas.rows import COST_SCHEMA, distinct_rows

    if isinstance(out, Path):
        filesystem, files = None, [str(f) for f in part_files(out / COSTS_DIR)]
    else:
        filesystem, files = dataset_parts(out, COSTS_DIR)
    if not files:
        return 0.0, 0.0, None
    # Every row of the run's workers finished inside the window (rows of earlier runs before it).
    since = pa.scalar(round(window.started_at * 1_000_000), COST_SCHEMA.field("finished_at").type)
    table = ds.dataset(files, format="parquet", schema=COST_SCHEMA, filesystem=filesystem).to_table(
        filter=ds.field("finished_at") >= since)
    names = window.worker_names(sorted(set(table["worker"].to_pylist())))
    table = table.filter(pc.is_in(table["worker"], value_set=pa.array(names, pa.string())))
    if table.num_rows:
        # A part published twice alike (a retried write) counts once, as compaction keeps it.
        table = distinct_rows(table)
    models = [m for m in table["model"].to_pylist() if m]
    return (float(pc.sum(table["device_s"]).as_py() or 0.0), float(pc.sum(table["cost_usd"]).as_py() or 0.0),
            models[0] if models else None)


def bill_remainder(out: Path | str, state_dir: Path, job_id: str, window: Window) -> dict | None:
    """Write the ``idle`` row of what the run's workers did not cover, and record the window in
    ``state_dir``. Returns the record (None when no worker was started)."""
    from mqinfer.schemas.dataset import COSTS_DIR
    from mqinfer.schemas.dataset_uri import dataset_writer
    from mqinfer.schemas.rows import COST_SCHEMA, CostRow

    if window.started_at is None or window.ended_at is None:
        return None
    wall = max(window.ended_at - window.started_at, 0.0)
    machine_s = wall * window.devices
    covered_s, covered_usd, model = _covered(out, window)
    remainder_s = max(machine_s - covered_s, 0.0)
    price = window.price_per_device_hour
    if remainder_s > 0 and wall > 0:
        dataset_writer(out, COSTS_DIR, COST_SCHEMA, RUN_WORKER).write([CostRow(
            kind="idle", model=model, device_s=remainder_s, cost_usd=remainder_s * price / 3600.0,
            price_per_device_hour=price, worker=RUN_WORKER, finished_at=window.ended_at,
            device_share=remainder_s / wall)])
    record = {
        "started_at": window.started_at, "ended_at": window.ended_at, "wall_s": wall, "devices": window.devices,
        "price_per_device_hour": price, "machine_device_s": machine_s,
        "machine_usd": machine_s * price / 3600.0, "workers_device_s": covered_s, "workers_usd": covered_usd,
        "remainder_device_s": remainder_s, "billed_device_s": covered_s + remainder_s,
        "billed_usd": covered_usd + remainder_s * price / 3600.0,
    }
    _append_record(state_dir, job_id, record)
    return record


def _append_record(state_dir: Path, job_id: str, record: dict) -> None:
    path = state_dir / MACHINE_DIR / f"{job_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {"job_id": job_id, "runs": []}
    doc.setdefault("runs", []).append(record)
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(doc, indent=1))
    os.replace(temp, path)


def machine_records(state_dir: Path, job_id: str) -> list[dict]:
    """Every run's window of ``job_id`` kept in ``state_dir``, oldest first."""
    try:
        return json.loads((state_dir / MACHINE_DIR / f"{job_id}.json").read_text()).get("runs", [])
    except (OSError, ValueError):
        return []


__all__ = ["RUN_WORKER", "Window", "bill_remainder", "machine_records", "settle_lost", "worker_shares"]
