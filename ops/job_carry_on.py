"""A bulk job's cost cap at submit time, and carrying on a job that its cap stopped.

``mqinfer jobs submit --max-cost-usd`` gives the job a cap in its cost hash (``keys.job_cost``, on
the request streams' server), which the inference workers enforce (``mqinfer.workers.queue.job_caps``):
once the job's spend plus the estimate of its requests in flight reaches the cap, no request of
the job starts; the rest end with ``budget_exceeded`` error rows, which the job collects like any
other row, so that it still completes, with those requests failed.

Submitting the same INPUT into the same ``--out`` again, once the job has ended, carries it on
(:func:`carry_on_rows`): the rows of the requests the cap stopped are dropped from the job's spool
and from its done sets, every other row is kept (its request is not computed again), and the job
runs again under the cap now given (none without ``--max-cost-usd``). Its spend so far stays in
its cost hash; when the server lost it, the job's ``request`` cost rows in the workers' folders
(``--worker-out``) give it back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pyarrow.compute as pc

from mqinfer.ops.job_cost import job_cost
from mqinfer.ops.job_spool import Spool
from mqinfer.schemas import keys
from mqinfer.schemas.errors import BUDGET_EXCEEDED

log = logging.getLogger("mqinfer.jobs")


def stopped_ids(spool: Spool, parts: Sequence[str]) -> set[str]:
    """Requests of the spool's rows that a cost cap (or a budget) stopped: every row of theirs is a
    ``budget_exceeded`` error, so they never ran."""
    if not parts:
        return set()
    rows = spool.read_rows(parts, ["id", "error_code"])
    refused = pc.equal(pc.fill_null(rows["error_code"], ""), BUDGET_EXCEEDED)
    stopped = set(pc.unique(rows.filter(refused)["id"]).to_pylist())
    if not stopped:
        return set()
    other = set(pc.unique(rows.filter(pc.invert(refused))["id"]).to_pylist())
    return stopped - other


def drop_rows(spool: Spool, parts: Sequence[str], ids: set[str]) -> list[str]:
    """Remove the rows of ``ids`` from the spool's row parts; returns the parts that hold the rest.

    A part with such rows is replaced by a new part without them, written before the old one is
    removed: a crash in between leaves both, and the output keeps one row per request anyway.
    """
    if not ids:
        return list(parts)
    kept: list[str] = []
    value_set = sorted(ids)
    for seq, name in enumerate(parts):
        table = spool.read_rows([name])
        drop = pc.is_in(table["id"], value_set=pc.cast(value_set, table.schema.field("id").type))
        if not pc.any(drop).as_py():
            kept.append(name)
            continue
        rest = table.filter(pc.invert(drop))
        if rest.num_rows:
            new_name = spool.new_rows_part_name(seq)
            spool.write_rows_part(new_name, rest)
            kept.append(new_name)
        (spool.rows_dir / name).unlink(missing_ok=True)
    return sorted(kept)


def forget_done(data, streams: Sequence[str], job_id: str, ids: set[str]) -> None:
    """Take ``ids`` out of the job's done set of every shard, so that feeding sends them again."""
    if not ids:
        return
    members = sorted(ids)
    pipe = data.pipeline(transaction=False)
    for stream in streams:
        for start in range(0, len(members), 10_000):
            pipe.srem(keys.job_done_set(stream, job_id), *members[start:start + 10_000])
    pipe.execute()


def carry_on_rows(spool: Spool, data, streams: Sequence[str], job_id: str) -> tuple[list[str], int]:
    """Ready the spool of an ended job to run the requests a cost cap stopped: (the row parts
    kept, how many requests will run again). Nothing changes when the cap stopped none."""
    parts = spool.existing_rows_parts()
    stopped = stopped_ids(spool, parts)
    if not stopped:
        return parts, 0
    parts = drop_rows(spool, parts, stopped)
    forget_done(data, streams, job_id, stopped)
    log.info("job %s carries on: %d requests its cost cap stopped run again", job_id, len(stopped))
    return parts, len(stopped)


def set_job_cap(data, job_id: str, max_cost_usd: float | None, worker_out: Sequence[str]) -> None:
    """The job's cost cap for the inference workers, on the request streams' server.

    Without a cap, any cap an earlier submission of the job left is removed (its spend stays). A
    job whose spend the server does not know (a new job, or one the server forgot) starts from
    the ``request`` cost rows of the job in ``worker_out``, when given.
    """
    key = keys.job_cost(job_id)
    if max_cost_usd is None:
        data.hdel(key, "max_cost_usd")
        return
    mapping = {"max_cost_usd": repr(float(max_cost_usd))}
    if data.hget(key, "spent_usd") is None and worker_out:
        spent = job_cost(worker_out, job_id).request_usd
        if spent > 0:
            mapping["spent_usd"] = repr(spent)
    data.hset(key, mapping=mapping)


__all__ = ["carry_on_rows", "drop_rows", "forget_done", "set_job_cap", "stopped_ids"]
