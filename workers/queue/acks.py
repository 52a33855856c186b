"""From a row to an acked entry: durable first, then the ack.

Rows are buffered in the Parquet sinks; a flush writes them durably (temp file, fsync, rename),
logs their requests (``finished ...``, ``<reason> row ...``: the log never counts more finished
requests than the results dataset holds), and only then does one transaction acknowledge their
entries with everything that goes with it: the entry leaves the stream (``XDEL``) and the
in-flight hash, its id joins the job's done set, a registered bulk job gets the row on its result
stream, the spend of its tenant and budgeted groups (``--enforce-budgets``) and of its capped job
(``--max-cost-usd``) grows by the row's cost, the job's count of
generated tokens is brought up to date, and the request's idempotency record becomes ``done``. Entries that end without a row of their own (a duplicate, a
dead letter, a lost entry another entry carries) are acked the same way.

A request with ``n`` > 1 choices has one row per choice; they are buffered together and its entry
is acked once all of them are durable. Its job's result stream gets every row, choice 0's first
with the cost of all of them (a bulk job counts a request once, by its first row).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec

from mqinfer.schemas import faults, keys
from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import CostRow, ResultRow
from mqinfer.workers.queue.billing import Billing
from mqinfer.workers.queue.context import QueueContext
from mqinfer.workers.queue.idempotency import waiting_reply_streams
from mqinfer.workers.queue.lanes import by_lane, split, stream_of
from mqinfer.workers.queue.sink import Sinks

log = logging.getLogger("mqinfer.worker")

# Done sets of jobs outlive their last row by a week.
DONE_SET_TTL_S = 7 * 24 * 3600


class SinkError(RuntimeError):
    """Result rows could not be written durably; the worker must not ack them."""


@dataclass(slots=True)
class PendingAck:
    """An entry to acknowledge once the rows buffered with it are durable."""

    entry_id: str
    # None: the entry ends without a row of its own (a duplicate, a dead letter, a lost entry).
    # Choice 0's row for a request with n > 1 choices.
    row: ResultRow | None = None
    # The row answers later copies of the request (kept with its idempotency record).
    keep_final: bool = False
    # The cost of every row of the request.
    cost_usd: float = 0.0
    # Every choice's row, in index order, for a request with n > 1 choices; None otherwise.
    choices: list[ResultRow] | None = None


class Acks:
    def __init__(self, context: QueueContext, *, sinks: Sinks, billing: Billing, job_caps=None) -> None:
        config = context.config
        self.redis = context.redis
        self.clock = context.clock
        self.stream = config.stream
        self.stream_key = keys.request_stream(config.stream)
        self.inflight_key = keys.inflight_hash(config.stream)
        self.group = config.group
        self.sinks = sinks
        self.billing = billing
        self.replies = context.replies
        self.idempotency = context.idempotency
        self.jobs = context.jobs
        self.metrics = context.metrics
        self.budget_guard = context.budget_guard
        # Capped jobs' spend (workers/queue/job_caps.py) grows as their rows are acked.
        self.job_caps = job_caps
        self.redis_cluster = config.redis_cluster
        self.pending: list[PendingAck] = []
        # Log lines of buffered rows, logged once the rows are durable: (format, args, fields).
        self._row_log: list[tuple[str, tuple, dict | None]] = []
        self._rows_buffered = 0
        # Result rows this worker made durable, by whether the engine computed them.
        self.rows_written = 0
        self.requests_finished = 0
        self._finished_buffered = 0

    # -- what ends an entry ------------------------------------------------------------------------
    def add_row(self, entry_id: str, row: ResultRow, cost: CostRow, *, reply_to: str | None = None,
                computed: bool = False, log_line: tuple[str, tuple, dict | None]) -> None:
        """Buffer a request's rows; its entry is acked once they are durable. ``computed``: the
        engine ran it (rather than refusing or ending it before it ran)."""
        self.add_choices(entry_id, [row], [cost], reply_to=reply_to, computed=computed, log_lines=[log_line])

    def add_choices(self, entry_id: str, rows: list[ResultRow], costs: list[CostRow], *,
                    reply_to: str | None = None, computed: bool = False,
                    log_lines: list[tuple[str, tuple, dict | None]]) -> None:
        """Buffer the rows of every choice of a request (in index order, one cost row each); its
        entry is acked once they are all durable, and its reply stream gets one final message."""
        for row, cost in zip(rows, costs, strict=True):
            self.sinks.add(row, cost)
        first = rows[0]
        cost_usd = sum(cost.cost_usd for cost in costs)
        choices = rows if len(rows) > 1 else None
        self.pending.append(PendingAck(entry_id, first, keep_final=computed and reply_to is not None,
                                       cost_usd=cost_usd if first.job_id is not None else 0.0, choices=choices))
        if reply_to is not None:
            self.replies.final_when_durable(reply_to, first, choices)
        if self.budget_guard is not None and computed:
            self.budget_guard.note(entry_id, first.tenant, cost_usd, first.finished_at, job_id=first.job_id,
                                   metadata=first.metadata)
        for row in rows:
            self.metrics.finish(row.finish_reason or "error")
        self._row_log.extend(log_lines)
        self._rows_buffered += len(rows)
        self._finished_buffered += computed

    def pending_usd(self, job_id: str) -> float:
        """The cost of this job's rows buffered or written and not acked yet."""
        return sum(p.cost_usd for p in self.pending if p.row is not None and p.row.job_id == job_id)

    def add_error(self, entry_id: str, request_id: str, job_id: str | None, code: str | None,
                  message: str | None, *, attempt: int, enqueued_at: float, request: Request | None = None,
                  finish_reason: str = "error") -> None:
        """A request that ends without running (invalid, refused, cancelled, lost): an error row
        (or one that says ``finish_reason``) and a zero cost row."""
        row, cost = self.billing.error(request_id, job_id, code, message, attempt=attempt,
                                       enqueued_at=enqueued_at, request=request, finish_reason=finish_reason)
        self.add_row(entry_id, row, cost, reply_to=request.reply_to if request is not None else None,
                     log_line=("%s row %s: %s: %s", (finish_reason, request_id, code, message), None))

    def add_without_row(self, entry_id: str) -> None:
        """An entry that ends without a row of its own: acked with the next rows."""
        self.pending.append(PendingAck(entry_id))

    def add_cost(self, cost: CostRow) -> None:
        """A cost row without a result (startup, idle, duplicate work)."""
        self.sinks.add_cost(cost)

    def holds(self) -> set[str]:
        """Entries waiting for their ack."""
        return {p.entry_id for p in self.pending}

    @property
    def rows_buffered(self) -> int:
        """Result and cost rows not yet durable."""
        return self.sinks.pending

    def should_flush(self) -> bool:
        return self.sinks.should_flush()

    # -- durable, then acked -----------------------------------------------------------------------
    def write(self) -> None:
        """Write every buffered row durably and log their requests; SinkError when that fails
        (nothing unwritten is acked: the entries stay pending and are redone elsewhere)."""
        try:
            self.sinks.flush()
            for fmt, args, fields in self._row_log:
                log.info(fmt, *args, extra={"fields": fields} if fields is not None else None)
            self._row_log.clear()
            faults.hit("sink.after_write")
        except OSError as exc:
            raise SinkError("writing Parquet part files failed") from exc
        self.metrics.rows_written.inc(self._rows_buffered)
        self.rows_written += self._rows_buffered
        self.requests_finished += self._finished_buffered
        self._rows_buffered = self._finished_buffered = 0
        self.replies.rows_durable()

    def ack(self) -> None:
        """Acknowledge the entries whose rows are durable, in one transaction with their side
        effects. Final reply messages (their rows durable now) go first; copies that waited for a
        row get it after the transaction."""
        self.replies.send(self.redis, self.clock())
        if not self.pending:
            return
        pending = self.pending
        ids = [p.entry_id for p in pending]
        pipe = self.redis.pipeline(transaction=True)
        charged = self.budget_guard.charge(pipe, ids) if self.budget_guard is not None else []
        # Each lane's entries leave their stream, its in-flight hash and their idempotency records
        # change in one transaction in the lane's slot: on one server, all lanes' in the one
        # transaction with the rest; in a Redis Cluster, each lane's in its own, after the one that
        # counts the rows done (so that a crash between them can only leave a row counted done whose
        # entry is delivered again, and compaction keeps one row).
        lane_pipes = []
        waiting: list[tuple[object, int, PendingAck]] = []
        rows = {p.entry_id: p for p in pending}
        for lane, qids in by_lane(ids).items():
            lane_pipe = pipe if lane is None or not self.redis_cluster else self.redis.pipeline(transaction=True)
            if lane_pipe is not pipe:
                lane_pipes.append(lane_pipe)
            lane_stream = stream_of(self.stream, lane)
            stream_key = keys.request_stream(lane_stream)
            raw = [split(q)[0] for q in qids]
            lane_pipe.xack(stream_key, self.group, *raw)
            lane_pipe.xdel(stream_key, *raw)  # acked entries leave the stream; pending ones never do
            lane_pipe.hdel(keys.inflight_hash(lane_stream), *raw)
            for qid in qids:
                p = rows[qid]
                if p.row is not None:
                    position = self.idempotency.queue_ack(lane_pipe, p.entry_id, p.row, p.keep_final, p.choices)
                    if position is not None:
                        waiting.append((lane_pipe, position, p))
        done: dict[str, list[str]] = {}
        for p in pending:
            if p.row is not None and p.row.job_id is not None:
                done.setdefault(p.row.job_id, []).append(p.row.id)
        for job_id, request_ids in done.items():
            key = keys.job_done_set(self.stream, job_id)
            pipe.sadd(key, *request_ids)
            pipe.expire(key, DONE_SET_TTL_S)
        # The job's generated tokens (same slot) go with its done set, so that a request counted
        # done has its tokens counted too (once the Redis user is known to be allowed them).
        generated = self.replies.generated
        counted = bool(generated) and generated.checked and generated.enabled
        if counted:
            generated.queue(pipe)
        # A job's result stream is in another slot: in a cluster it cannot join the transaction.
        results_pipe = self.redis.pipeline(transaction=False) if self.redis_cluster else pipe
        for p in pending:
            row = p.row
            if row is not None and row.job_id is not None and self.jobs.wants_rows(row.job_id):
                stream = keys.job_results_stream(row.job_id)
                results_pipe.xadd(stream, {"id": row.id, "row": msgspec.json.encode(row), "cost_usd": repr(p.cost_usd)})
                for choice in (p.choices or ())[1:]:
                    results_pipe.xadd(stream, {"id": choice.id, "row": msgspec.json.encode(choice)})
        capped = [] if self.job_caps is None else self.job_caps.queue_charges(
            results_pipe, [(p.row.job_id, p.cost_usd) for p in pending if p.row is not None and p.row.job_id])
        results = {id(pipe): pipe.execute()}
        for lane_pipe in lane_pipes:
            results[id(lane_pipe)] = lane_pipe.execute()
        if counted:
            generated.sent(self.clock())
        for entry_id in ids:
            self.idempotency.forget(entry_id)
        for lane_pipe, position, p in waiting:
            for reply_to in waiting_reply_streams(results[id(lane_pipe)][position]):
                self.replies.final(reply_to, p.row, p.choices)
        self.replies.send(self.redis, self.clock())
        if results_pipe is not pipe:
            results_pipe.execute()
        if charged:
            self.budget_guard.charged(charged)
        if capped:
            self.job_caps.charged(capped)
        self.pending = []
