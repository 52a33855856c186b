"""One task's work on one bulk job (:class:`JobRun`): what it does depends on the job's status.

- ``validating``: read the next chunk of the input, validate it, write it to the spool index
  (requests ready to send, or the line's error, and with ``order`` prefix the part's feed order);
  at the end of the input look for repeated ids and fail the job if the input is unusable
  (unreadable, or not one valid request in it).
- ``in_progress``: collect result rows from the job's result stream into the spool (a Parquet
  part is made durable before the cursor moves), then feed the next requests to the request
  streams while fewer than ``max_in_flight`` are out. Requests that already have a row (their id
  is in a done set of the job's streams) are skipped, not sent again. Every so often, requests in
  flight whose stream entry vanished without a row are sent again.
- ``cancelling``, or ``in_progress`` past the deadline: stop feeding, collect what the workers
  still return (they end the job's requests as cancelled / expired), then finalize.
- ``finalizing``: collect the last rows and write the output (:mod:`mqinfer.ops.job_output`).

**Order.** With ``order`` prefix (the job hash's field, set at submit) each index part of
INDEX_PART_LINES lines is fed in prefix-tree order
(:func:`mqinfer.schemas.prefix_order.prefix_key`, under the job's ``prefix_cache_scope``, the
workers': by tenant and cache salt first by default), so requests of the part that can share a prompt prefix reach the
workers next to each other and the prefix is computed once while its KV blocks are cached. The order is per part, not across the whole input: requests that share a prefix but lie in
different parts are not brought together. The permutation is stored in the index part when it is
validated, and the feed cursor (``feed_part``, ``feed_offset``) counts positions in it, so a
resumed task continues exactly where the last one stopped. The index itself stays in input order,
and so does the output.

**Route.** With ``route`` prefix and ``shards`` > 1, each task's
:class:`~mqinfer.schemas.routing.PrefixRouter` picks the shard of every request it feeds from its
leading prompt (its loads start afresh with each task). It places each feed step's requests so that
the work sent to the shards stays within its balance slack, which keeps every shard busy while the
feed walks through the prefixes in order: a prefix with more requests in a step than a shard's
share spills over to another shard, which then caches it too. So a request's shard is no longer a
function of its id: it is kept in the in-flight map, where the reconcile looks for the request's
entry (and where a lost request is sent again, so that the worker's idempotency record of that
stream sees a second copy), and a request counts as done when any shard's done set holds it.
Cancelling needs no shard: workers of every stream read the job's status.

**Lanes.** Within its shard's stream each request goes to its lane (the job hash's ``lanes``,
:mod:`mqinfer.schemas.lanes`; a job registered before lanes feeds the plain streams). With
`mqinfer jobs submit`'s default ``tenant,job`` every job has a lane of its own, so the workers read
a job submitted behind another beside that one's backlog, not after it (each job also has its own
``max_in_flight``, so a new job is fed at once whatever the others have out). The in-flight
record keeps the lane with the shard: entry ids are unique only within a stream, so the reconcile
looks an entry up in the lane it was added to, and sends a lost request back there. The job's own
lanes are removed when it ends (:meth:`mqinfer.ops.job_store.JobStore.finish`).

The task around it (the lock, its lease, the next task, failures) is :mod:`mqinfer.ops.job_tasks`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import msgspec
import redis
from rq import Queue
from rq.serializers import JSONSerializer

from mqinfer.schemas import keys
from mqinfer.schemas.keys import shard_index, shard_streams
from mqinfer.schemas.lanes import DEFAULT_MAX_LANES, parse_lanes
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE
from mqinfer.schemas.routing import PrefixRouter, tier_homes_from
from mqinfer.ops.job_cost import JobCost, job_cost, rows_since
from mqinfer.ops.job_input import InputPosition, InputUnusable, read_chunk
from mqinfer.ops.job_lanes import JobLanes
from mqinfer.ops.job_output import compose_output
from mqinfer.ops.job_spool import Spool
from mqinfer.ops.job_validation import MAX_REPORTED_ERRORS, index_chunk, refuse_choices, repeated_ids
from mqinfer.ops.job_store import (
    CANCELLED, CANCELLING, FAILED, FINAL_STATUSES, FINALIZING, IN_PROGRESS, VALIDATING, CollectedRow,
    FeedItem, InFlight, JobStore, StatusChanged, entry_stream_key,
)
from mqinfer.schemas.request import decode_request
from mqinfer.schemas.rows import RESULT_SCHEMA, ResultRow, rows_to_table

log = logging.getLogger("mqinfer.jobs")

INDEX_PART_LINES = 4096      # input lines validated per step (and per spool index part)
COLLECT_MAX_ROWS = 2048      # result rows read per collect step
PART_MIN_ROWS = 256          # spool a part once this many rows wait (or max_in_flight / 4)...
PART_MAX_AGE_S = 2.0         # ...or once the oldest waiting row is this old
IDLE_WAIT_S = 1.0            # how long an idle task blocks for new rows when no other job waits
WAIT_SLICE_S = 0.1           # an idle task looks at the queue this often while it waits
RECONCILE_EVERY_S = 30.0     # how often requests in flight are checked for vanished entries
END_GRACE_S = 60.0           # a cancelled or expired job waits this long for rows still in flight

_ROW_DECODER = msgspec.json.Decoder(ResultRow)
_COUNTER_FOR_REASON = {"stop": "completed", "length": "completed", "error": "failed",
                       "cancelled": "cancelled", "expired": "expired"}


def _s(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _entry_time(entry_id: str) -> float:
    try:
        return int(entry_id.split("-", 1)[0]) / 1000.0
    except ValueError:
        return time.time()



class JobRun:
    """The work of one task on one job; ``advance()`` returns True once the job is final."""

    def __init__(self, store: JobStore, token: str, queue_name: str, *, budget_s: float,
                 clock=time.time) -> None:
        self.store = store
        self.token = token
        self.redis = store.redis  # the jobs server: job state and the rq queue
        self.data = store.data    # the request and result streams (the same server, or another)
        self.clock = clock
        self.queue_key = Queue(queue_name, connection=store.redis, serializer=JSONSerializer).key
        self.ends_at = time.monotonic() + budget_s
        self.job = store.load()
        self.job_id = store.job_id
        self.spool = Spool(str(self.job["out"]))
        stream = str(self.job["stream"])
        self.shards = int(self.job.get("shards") or 1)
        self.streams = shard_streams(stream, self.shards)
        self.stream_keys = [keys.request_stream(s) for s in self.streams]
        # Done sets stay keyed by the shard's plain stream, whatever lane a request went to.
        self.done_keys = [keys.job_done_set(s, self.job_id) for s in self.streams]
        # A job registered before these fields existed fed in input order, routed by id and fed
        # the plain streams.
        self.order = str(self.job.get("order") or "input")
        # The workers' scope, which the job's prefix groups keep to (a job registered before the
        # field existed: the default).
        self.prefix_cache_scope = str(self.job.get("prefix_cache_scope") or DEFAULT_PREFIX_CACHE_SCOPE)
        self.router = PrefixRouter(self.shards, route=str(self.job.get("route") or "id"),
                                   prefix_cache_scope=self.prefix_cache_scope)
        if self.router.by_prefix:
            # Prefixes go where the workers' KV tiers hold them (docs/kv-tiers.md).
            self.router.tier_homes = tier_homes_from(self.data, self.streams)
        self.lanes = JobLanes(self.data, self.streams, parse_lanes(str(self.job.get("lanes") or "none")),
                              int(self.job.get("max_lanes") or DEFAULT_MAX_LANES), self.job_id)
        self.deadline = float(self.job["deadline"]) if self.job.get("deadline") else None
        self._index_parts: dict[int, tuple[list, list, list, list | None]] = {}
        self._dup_lines: set[int] | None = None
        self._groups_ready = False
        self._pending_rows = 0
        self._last_row_id: str | None = None
        self._oldest_pending: float | None = None
        # The fewest tasks seen waiting in the queue during this task: more than that means a task
        # came in meanwhile.
        self._queue_low = int(self.redis.llen(self.queue_key))

    def out_of_budget(self) -> bool:
        return time.monotonic() >= self.ends_at

    def task_arrived(self) -> bool:
        """Whether a task joined the queue during this one: most often a job just submitted, which
        then gets this rq worker at once (to be validated and fed) instead of after this task's
        budget; a job's tasks take turns anyway."""
        queued = int(self.redis.llen(self.queue_key))
        self._queue_low = min(self._queue_low, queued)
        return queued > self._queue_low

    def reload(self) -> None:
        self.job = self.store.load()

    def advance(self) -> bool:
        while True:
            status = str(self.job["status"])
            if status in FINAL_STATUSES:
                return True
            step = {VALIDATING: self.validate, IN_PROGRESS: self.work, CANCELLING: self.work,
                    FINALIZING: self.finalize}.get(status)
            if step is None:
                raise ValueError(f"job {self.job_id} has an unknown status {status!r}")
            try:
                moved = step()
            except StatusChanged:
                moved = True  # a cancel came in between: look again
            self.reload()
            if str(self.job["status"]) in FINAL_STATUSES:
                return True
            if not moved or self.out_of_budget():
                return False

    # -- validating --------------------------------------------------------------------------
    def validate(self) -> bool:
        while not self.out_of_budget():
            position = InputPosition.decode(str(self.job.get("val_pos") or ""))
            try:
                items, next_position, at_end = read_chunk(str(self.job["input"]), position, INDEX_PART_LINES)
            except InputUnusable as exc:
                return self.fail(str(exc))
            if items:
                self._index_chunk([refuse_choices(item) for item in items], next_position)
            elif not at_end:
                raise RuntimeError(f"job {self.job_id}: input reader made no progress at {position}")
            if at_end:
                return self._end_validation()
            self.reload()
            if self.task_arrived():
                return False
        return False

    def _index_chunk(self, items, next_position: InputPosition) -> None:
        reported = json.loads(str(self.job.get("errors") or "[]"))
        chunk = index_chunk(items, self.job_id, self.deadline, self.order, self.prefix_cache_scope)
        reported += chunk.errors[: max(0, MAX_REPORTED_ERRORS - len(reported))]
        fmt = str(self.job.get("format") or "")
        for line_fmt in chunk.formats:
            fmt = line_fmt if fmt in ("", line_fmt) else "mixed"
        part = int(self.job.get("val_parts") or 0)
        self.spool.write_index_part(part, chunk.columns, chunk.feed_order)
        self.store.update(self.token, {"val_pos": next_position.encode(), "val_parts": part + 1, "format": fmt,
                                       "errors": reported},
                          incr={"total": len(items), "invalid": chunk.invalid}, expect_status=VALIDATING)

    def _end_validation(self) -> bool:
        self.reload()
        total, invalid = int(self.job.get("total") or 0), int(self.job.get("invalid") or 0)
        if total == 0:
            return self.fail(f"{self.job['input']} holds no requests (it is empty or every line is blank)")
        if invalid == total:
            first = json.loads(str(self.job.get("errors") or "[]"))[:3]
            shown = "; ".join(f"line {e['line']}: {e['message']}" for e in first)
            return self.fail(f"none of the {total} lines of {self.job['input']} is a valid request ({shown})")
        parts = int(self.job["val_parts"])
        index = self.spool.read_index(parts, ["line", "id", "error_code"])
        duplicates = repeated_ids(index)
        self.spool.write_duplicates(duplicates)
        now = self.clock()
        self.store.update(self.token, {"status": IN_PROGRESS, "in_progress_at": now, "validated": 1,
                                       "duplicates": duplicates.num_rows, "feed_part": 0, "feed_offset": 0},
                          expect_status=VALIDATING)
        log.info("job %s: validated %d lines (%d invalid, %d repeated ids); in progress",
                 self.job_id, total, invalid, duplicates.num_rows)
        return True

    def fail(self, reason: str) -> bool:
        self.store.finish(self.token, {"status": FAILED, "failed_at": self.clock(), "error": reason},
                          expect_status=VALIDATING)
        log.warning("job %s failed: %s", self.job_id, reason)
        return True

    # -- in progress, cancelling, expiring ---------------------------------------------------
    def _ending(self) -> str | None:
        if self.job["status"] == CANCELLING:
            return "cancelled"
        if self.deadline is not None and self.clock() >= self.deadline:
            return "expired"
        return None

    def _feed_done(self) -> bool:
        return int(self.job.get("feed_part") or 0) >= int(self.job.get("val_parts") or 0)

    def work(self) -> bool:
        if self.job["status"] == CANCELLING and self.store.split:
            # The inference workers read the status on the data server; `jobs cancel` may have
            # been run without it (only the jobs server given).
            self.store.mirror(CANCELLING)
        if self.job["status"] == CANCELLING and not int(self.job.get("validated") or 0):
            self.store.finish(self.token, {"status": CANCELLED, "cancelled_at": self.clock(),
                                           "error": "cancelled before its input was validated; nothing ran"},
                              expect_status=CANCELLING)
            return True
        while True:
            ending = self._ending()
            progressed = self.collect(force=ending is not None or self._feed_done())
            if ending is None:
                progressed = self.feed() or progressed
                progressed = self.reconcile() or progressed
            in_flight = self.store.inflight_count()
            if ending is None and self._feed_done() and in_flight == 0:
                return self._to_finalizing("completed")
            if ending is not None:
                since = float(self.job.get("cancelling_at") or 0) if ending == "cancelled" else self.deadline
                if in_flight == 0 or self.clock() - (since or 0) >= END_GRACE_S:
                    return self._to_finalizing(ending)
            if self.out_of_budget() or self.task_arrived():
                return False
            if not progressed and not self._wait_for_rows():
                return False

    def _to_finalizing(self, ending: str) -> bool:
        self.store.update(self.token, {"status": FINALIZING, "finalizing_at": self.clock(), "ending": ending},
                          expect_status=str(self.job["status"]))
        log.info("job %s: finalizing (%s)", self.job_id, ending)
        return True

    def _wait_for_rows(self) -> bool:
        """Block briefly for new rows; False when the task should rather yield to other jobs: they
        were waiting when the wait began (unless rows came and the job has sent every request: its
        rows are then all it waits for, and collecting them at once ends it sooner), or one came in
        during the wait (looked for every ``WAIT_SLICE_S``: see :meth:`task_arrived`)."""
        queued = int(self.redis.llen(self.queue_key))
        wait = IDLE_WAIT_S if queued == 0 else min(IDLE_WAIT_S, 0.5 / queued)
        wait = min(wait, self.ends_at - time.monotonic())
        if self._oldest_pending is not None:
            wait = min(wait, self._oldest_pending + PART_MAX_AGE_S - self.clock() + 0.01)
        ends = time.monotonic() + wait
        last = self._last_row_id or str(self.job.get("cursor") or "") or "0-0"
        while (left := ends - time.monotonic()) > 0.01:
            block_ms = max(1, int(min(left, WAIT_SLICE_S) * 1000))
            if self.data.xread({self.store.results_key: last}, count=1, block=block_ms):
                return queued == 0 or self._feed_done()
            if self.task_arrived():
                return False
        return queued == 0

    def _index_part(self, part: int) -> tuple[list, list, list, list | None]:
        """Lines, ids and payloads of index part ``part`` in input order, and its feed order (the
        rows in the order they are fed; None for input order)."""
        cached = self._index_parts.get(part)
        if cached is None:
            table = self.spool.read_index_part(part, ["line", "id", "request"])
            cached = (table["line"].to_pylist(), table["id"].to_pylist(), table["request"].to_pylist(),
                      self.spool.read_feed_order(part))
            self._index_parts = {part: cached}  # one part at a time: parts are read in order
        return cached

    def _duplicate_lines(self) -> set[int]:
        if self._dup_lines is None:
            self._dup_lines = set(self.spool.read_duplicates()["line"].to_pylist())
        return self._dup_lines

    def _ensure_group(self) -> None:
        if self._groups_ready:
            return
        for stream_key in self.stream_keys:
            try:
                self.data.xgroup_create(stream_key, keys.GROUP, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._groups_ready = True

    def _shard(self, request_id: str) -> int:
        """The shard of a request's id hash: where routing by id sends it."""
        return shard_index(request_id, self.job_id, self.shards)

    def _flight_shard(self, request_id: str, record: InFlight) -> int:
        """The shard a request in flight was sent to (its id's, for a record that kept none)."""
        if record.shard is not None and 0 <= record.shard < self.shards:
            return record.shard
        return self._shard(request_id)

    def _done(self, ids: list[str]) -> list[bool]:
        """Whether each request already has a durable row: its id is in the done set of any of the
        job's shards. Every shard is asked, not the id's: routed by prefix, a request's row is
        noted by the workers of the shard it went to, and rows adopted from the spool on a resume
        are noted in the id's shard (:func:`mqinfer.ops.jobs._adopt_rows`)."""
        if not ids:
            return []
        if self.shards == 1:
            return [bool(d) for d in self.data.smismember(self.done_keys[0], ids)]
        pipe = self.data.pipeline(transaction=False)
        for done_key in self.done_keys:
            pipe.smismember(done_key, ids)
        out = [False] * len(ids)
        for found in pipe.execute():
            out = [o or bool(d) for o, d in zip(out, found)]
        return out

    def feed(self) -> bool:
        if self._feed_done():
            return False
        out = self.store.inflight_count() - self._pending_rows
        room = int(self.job["max_in_flight"]) - out
        if room <= 0:
            return False
        # The cursor: a part, and a position in that part's feed order.
        part, offset = int(self.job.get("feed_part") or 0), int(self.job.get("feed_offset") or 0)
        lines, ids, payloads, order = self._index_part(part)
        dups = self._duplicate_lines()
        want = min(room, int(self.job["chunk_size"]))
        items: list[FeedItem] = []
        i = offset
        while i < len(lines) and len(items) < want:
            row = order[i] if order is not None else i
            if payloads[row] is not None and lines[row] not in dups:
                items.append(FeedItem(ids[row], f"{part}:{row}", payloads[row], self._shard(ids[row])))
            i += 1
        next_part, next_offset = (part + 1, 0) if i >= len(lines) else (part, i)
        skipped = 0
        if items:
            done = self._done([item.id for item in items])
            if any(done):
                skipped = sum(1 for d in done if d)
                items = [item for item, d in zip(items, done) if not d]
            items = self._destine(items, route=True)
        self.store.commit_feed(self.token, self.streams, items, feed_part=next_part, feed_offset=next_offset,
                               skipped=skipped)
        self.reload()
        return True

    def _destine(self, items: list[FeedItem], *, route: bool) -> list[FeedItem]:
        """``items`` with the stream each goes to: the shard the router picks (with ``route``;
        unchanged when routing by id) and the lane of that shard's stream, registered, with the
        workers' consumer groups in place."""
        if not items:
            return items
        self._ensure_group()
        route = route and self.router.by_prefix
        if not route and self.lanes.mode == "none":
            return items
        requests = [decode_request(item.payload, fmt="msgpack") for item in items]
        if route:
            items = [dataclasses.replace(item, shard=shard)
                     for item, shard in zip(items, self.router.assign(requests))]
        if self.lanes.mode != "none":
            items = [dataclasses.replace(item, lane=self.lanes.lane_for(item.shard, req.tenant))
                     for item, req in zip(items, requests)]
            self.store.note_lanes(self.lanes.take_new_own())
        return items

    def collect(self, *, force: bool) -> bool:
        cursor = str(self.job.get("cursor") or "")
        entries = self.data.xrange(self.store.results_key, min=f"({cursor}" if cursor else "-", max="+",
                                    count=COLLECT_MAX_ROWS)
        self._pending_rows = len(entries)
        if not entries:
            self._oldest_pending = None
            return False
        first_id, last_id = _s(entries[0][0]), _s(entries[-1][0])
        self._last_row_id = last_id
        self._oldest_pending = _entry_time(first_id)
        threshold = max(1, min(PART_MIN_ROWS, int(self.job["max_in_flight"]) // 4))
        if not force and len(entries) < threshold and self.clock() - self._oldest_pending < PART_MAX_AGE_S:
            return False
        rows: list[ResultRow] = []
        counted: list[CollectedRow] = []
        for entry_id, fields in entries:
            fields = {_s(k): v for k, v in fields.items()}
            try:
                row = _ROW_DECODER.decode(fields["row"])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("job %s: result entry %s is unreadable (%s); skipped", self.job_id, _s(entry_id), exc)
                continue
            rid = _s(fields["id"]) if "id" in fields else row.id
            cost = None
            if "cost_usd" in fields:
                try:
                    cost = float(_s(fields["cost_usd"]))
                except ValueError:
                    cost = None
            rows.append(row)
            counted.append(CollectedRow(rid, _COUNTER_FOR_REASON.get(row.finish_reason, "failed"),
                                        int(row.prompt_tokens), int(row.output_tokens), cost))
        part_name = None
        if rows:
            part_name = self.spool.new_rows_part_name(int(self.job.get("row_parts") or 0))
            self.spool.write_rows_part(part_name, rows_to_table(rows, RESULT_SCHEMA))
        self.store.commit_collect(self.token, last_id, part_name, counted)
        self._pending_rows = 0
        self._oldest_pending = None
        self.reload()
        return True

    def reconcile(self) -> bool:
        """Send again the requests in flight whose stream entry is gone without a row (a trimmed or
        deleted stream): nothing else would ever finish them."""
        now = self.clock()
        last = float(self.job.get("reconciled_at") or self.job.get("in_progress_at") or now)
        if now - last < RECONCILE_EVERY_S:
            return False
        in_flight = self.store.inflight()
        lost: list[FeedItem] = []
        if in_flight:
            # '-': noted in flight by a two-server feed that never recorded the entry (it may
            # never have been sent): treated as gone unless the request has a row.
            # Each entry is looked for in the stream it was sent to (its shard's, in its lane),
            # and a lost request goes back there: a copy of it that still exists (a two-server
            # feed cut after its XADD) is then a duplicate for that stream's idempotency record,
            # not a second computation.
            rids = [rid for rid in in_flight if in_flight[rid].entry_id != "-"]
            gone = [rid for rid in in_flight if in_flight[rid].entry_id == "-"]
            pipe = self.data.pipeline(transaction=False)
            for rid in rids:
                record = in_flight[rid]
                shard = self._flight_shard(rid, record)
                pipe.xrange(entry_stream_key(self.streams, shard, record.lane), min=record.entry_id,
                            max=record.entry_id, count=1)
            gone += [rid for rid, found in zip(rids, pipe.execute() if rids else []) if not found]
            if gone:
                for rid, d in zip(gone, self._done(gone)):
                    if d:
                        continue
                    locator = in_flight[rid].locator
                    part, _, row = locator.partition(":")
                    _, ids, payloads, _ = self._index_part(int(part))
                    if ids[int(row)] == rid:
                        lost.append(FeedItem(rid, locator, payloads[int(row)],
                                             self._flight_shard(rid, in_flight[rid])))
        if lost:
            log.warning("job %s: %d requests in flight lost their stream entry; sending them again",
                        self.job_id, len(lost))
            # Back to the lane of the shard's stream the request belongs in (registered again, in
            # case the workers removed it meanwhile): the lane of its first copy.
            lost = self._destine(lost, route=False)
            self.store.commit_feed(self.token, self.streams, lost, feed_part=None, feed_offset=None,
                                   counter="refed")
        self.store.update(self.token, {"reconciled_at": now})
        self.reload()
        return bool(lost)

    # -- finalizing --------------------------------------------------------------------------
    def finalize(self) -> bool:
        while self.collect(force=True):
            if self.out_of_budget():
                return False
        ending = str(self.job.get("ending") or "completed")
        now = self.clock()
        summary = compose_output(
            self.spool, job_id=self.job_id, index_parts=int(self.job["val_parts"]),
            row_parts=self.store.part_names(), ending=ending, openai=self.job.get("format") in ("openai", "mixed"),
            now=now,
        )
        fields = {
            "status": ending, f"{ending}_at": now, "output_rows": summary.rows, "completed": summary.completed,
            "failed": summary.failed, "cancelled": summary.cancelled, "expired": summary.expired,
            "prompt_tokens": summary.prompt_tokens, "output_tokens": summary.output_tokens,
            "budget_exceeded": summary.budget_exceeded,
        }
        cost = self._final_cost()
        if cost is not None:
            fields.update({"rows_cost_usd": cost.cost_usd, "rows_request_usd": cost.request_usd,
                           "rows_duplicate_usd": cost.duplicate_usd, "rows_device_s": cost.device_s,
                           "rows_cost_count": cost.rows})
        self.store.finish(self.token, fields, expect_status=FINALIZING)
        # The index duplicates the input and the output has everything now; a resubmission of the
        # same input into this folder validates it again anyway.
        self.spool.reset_index()
        self.spool.clean()
        log.info("job %s %s: %d rows in %s; cost %s", self.job_id, ending, summary.rows, self.spool.out,
                 f"${cost.cost_usd:.6f} from {cost.rows} cost rows" if cost is not None
                 else f"${float(self.job.get('cost_usd') or 0):.6f} from the result stream (no --worker-out)")
        return True

    def _final_cost(self) -> JobCost | None:
        """The job's cost from the cost rows in the workers' folders it names, or None without any.

        Every request's cost row is durable by now: a worker writes it before the request's result
        reaches the job's result stream, and every result is collected. A ``duplicate`` row written
        later (work handed back by a worker still draining) counts in ``jobs status --worker-out``."""
        folders = json.loads(str(self.job.get("worker_out") or "[]"))
        return job_cost(folders, self.job_id, since=rows_since(self.job)) if folders else None
