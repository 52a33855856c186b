"""Ownership: the stream entries a worker holds, from decode to ack, and keeping them its own.

While a request runs, its entry is re-claimed by this worker (``XCLAIM ... JUSTID``, the
keepalive) so its idle time stays low and only a dead worker's entries are taken over. An entry
another worker took over while this one was stalled is dropped here (its device time becomes a
``duplicate`` cost row); one trimmed from the stream while it ran here is finished from memory.
Cancels (``Client.cancel``, or a bulk job being cancelled) stop requests. At shutdown, what will
not finish is handed back, claimable at once and without counting a delivery.

Lost entries: a dead worker's pending entry trimmed from the stream ends with a ``lost`` error row
when the in-flight hash still names its request; entries trimmed before any worker read them
are counted and logged (their ids can never be known).
"""

from __future__ import annotations

import json
import logging

import redis

from mqinfer.schemas import errors, keys
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.replies import cancel_key, cancel_member
from mqinfer.schemas.request import Request
from mqinfer.schemas.stream import encode_entry
from mqinfer.workers.queue.acks import Acks
from mqinfer.workers.queue.context import QueueContext
from mqinfer.workers.queue.entries import InFlight, entry_order, entry_time, text
from mqinfer.workers.queue.consumer_group import HANDBACK_CONSUMER, DeadLetters
from mqinfer.workers.queue.lanes import by_lane, key_of, qualify, split, stream_of

log = logging.getLogger("mqinfer.worker")

# Entries re-claimed per XPENDING / XCLAIM call at most.
KEEPALIVE_CHUNK = 1000
# A gap's marker key (one worker reports each gap) lives a week.
GAP_MARKER_TTL_S = 7 * 24 * 3600


class Ownership:
    def __init__(self, context: QueueContext, *, engine, batcher, acks: Acks, dead_letters: DeadLetters) -> None:
        config = context.config
        self.redis = context.redis
        self.config = config
        self.consumer = context.consumer
        self.stream_key = keys.request_stream(config.stream)
        self.inflight_key = keys.inflight_hash(config.stream)
        self.cancel_key = cancel_key(config.stream)
        self.engine = engine
        self.batcher = batcher
        # Requests of rate-limited tenants waiting on their limits (None without --tenant-limits).
        self.throttle = context.throttle
        self.idempotency = context.idempotency
        self.acks = acks
        self.dead_letters = dead_letters
        self.jobs = context.jobs
        self.metrics = context.metrics
        self.inflight: dict[str, InFlight] = {}
        # Taken over (or finished) by another worker while running here: its row is not ours.
        self.disowned: set[str] = set()
        # Trimmed from the stream while running here: finished from memory, never kept fresh.
        self.detached: set[str] = set()
        self._cancels_allowed = True
        self._last_keepalive = 0.0
        # Per lane: the last delivered id after which a gap was reported.
        self._gap_reported: dict[str | None, str] = {}

    def lane_key(self, lane: str | None) -> str:
        """The stream key of a lane (the plain stream for None)."""
        return key_of(self.config.stream, lane)

    def __contains__(self, entry_id: str) -> bool:
        return entry_id in self.inflight

    def __len__(self) -> int:
        return len(self.inflight)

    def take(self, item: InFlight) -> None:
        self.inflight[item.entry_id] = item

    def get(self, entry_id: str) -> InFlight | None:
        return self.inflight.get(entry_id)

    def owns(self, entry_id: str) -> bool:
        """Held here and still this worker's: its output and row count."""
        return entry_id in self.inflight and entry_id not in self.disowned

    def release(self, entry_id: str) -> tuple[InFlight, bool]:
        """The engine is done with an entry: (its item, whether its row is still this worker's)."""
        item = self.inflight.pop(entry_id)
        if entry_id in self.disowned:
            self.disowned.discard(entry_id)
            return item, False
        return item, True

    def stop(self, entry_id: str) -> bool:
        """Cancel a request the engine holds, every choice of it (its next step reports them); False
        when it has none."""
        if not self.engine.holds(entry_id):
            return False
        self.engine.cancel(entry_id)
        return True

    # -- keeping entries ours ----------------------------------------------------------------------
    def keepalive(self, now: float) -> bool:
        """Reset the idle time of the entries this worker is working on (and notice lost ones);
        False when it was not time yet."""
        if now - self._last_keepalive < min(self.config.claim_idle_ms / 3000.0, 1.0):
            return False
        self._last_keepalive = now
        # Finished entries whose rows wait for a flush stay ours until acked: keep them fresh too.
        mine = [e for e in self.inflight if e not in self.disowned and e not in self.detached]
        mine += [p.entry_id for p in self.acks.pending if p.entry_id not in self.detached]
        if not mine:
            return True
        for lane, qids in by_lane(mine).items():
            self._keep_lane(lane, qids)
        return True

    def _keep_lane(self, lane: str | None, mine: list[str]) -> None:
        """The keepalive of one lane's entries (qualified ids)."""
        stream_key = self.lane_key(lane)
        owned = set()
        for start in range(0, len(mine), KEEPALIVE_CHUNK):
            chunk = [split(q)[0] for q in mine[start:start + KEEPALIVE_CHUNK]]
            lo, hi = min(chunk, key=entry_order), max(chunk, key=entry_order)
            for p in self.redis.xpending_range(stream_key, self.config.group, lo, hi, len(chunk) * 4 + 10,
                                               consumername=self.consumer):
                owned.add(qualify(text(p["message_id"]), lane))
        still = [e for e in mine if e in owned]
        if still:
            kept = {qualify(text(e), lane) for e in self.redis.xclaim(
                stream_key, self.config.group, self.consumer, 0, [split(q)[0] for q in still], justid=True)}
            # XCLAIM drops entries that are gone from the stream from our pending list.
            self.sort_out_gone([e for e in still if e not in kept], pending_elsewhere=[])
            self.apply_cancels(still)
        gone = [e for e in mine if e not in owned]
        if gone:
            pipe = self.redis.pipeline(transaction=False)
            for qid in gone:
                entry_id = split(qid)[0]
                pipe.xpending_range(stream_key, self.config.group, entry_id, entry_id, 1)
            owners = pipe.execute()
            self.sort_out_gone(gone, pending_elsewhere=[e for e, o in zip(gone, owners) if o])

    def trimmed_while_running(self, entry_id: str) -> None:
        """A claim scan reported an entry running here as deleted from the stream."""
        if entry_id not in self.detached and entry_id not in self.disowned:
            self.sort_out_gone([entry_id], pending_elsewhere=[])

    def sort_out_gone(self, entry_ids: list[str], *, pending_elsewhere: list[str]) -> None:
        """Entries running here that are no longer pending under this worker: drop or keep our copy.

        Pending under another consumer: it took the entry over while we were stalled, drop ours.
        Pending nowhere: either that worker finished it (its idempotency record says ``done``),
        or the entry was trimmed from the stream while it ran here; then nobody else can run it,
        so we finish it from memory (without a record to tell, we finish it too: a duplicate row
        is removed by compaction, a dropped one is lost). Entries already finished here keep their
        buffered row either way.
        """
        entry_ids = [e for e in entry_ids if e in self.inflight]
        if not entry_ids:
            return
        elsewhere = set(pending_elsewhere)
        finished = self.idempotency.done_elsewhere([e for e in entry_ids if e not in elsewhere])
        for entry_id in entry_ids:
            if entry_id not in elsewhere and entry_id not in finished:
                log.warning("entry %s was removed from the stream while running here; finishing it from memory",
                            entry_id)
                self.metrics.trimmed_in_flight.inc()
                self.detached.add(entry_id)
                continue
            log.warning("entry %s was %s by another worker; dropping our copy", entry_id,
                        "claimed" if entry_id in elsewhere else "finished")
            self.idempotency.forget(entry_id)
            self.disowned.add(entry_id)
            self._unthrottle(entry_id)
            if not self.stop(entry_id):
                self.inflight.pop(entry_id, None)
                self.disowned.discard(entry_id)

    # -- cancels -----------------------------------------------------------------------------------
    def apply_cancels(self, entry_ids: list[str]) -> None:
        """Requests their producer cancelled (``Client.cancel``) stop now and end ``cancelled``.

        One ZMSCORE for all of them; a cancel older than the request's entry is for an earlier
        request with the same id and is ignored.
        """
        items = [self.inflight[e] for e in entry_ids if self.owns(e)]
        if not items or not self._cancels_allowed:
            return
        try:
            scores = self.redis.zmscore(self.cancel_key,
                                        [cancel_member(i.request.id, i.request.job_id) for i in items])
        except redis.exceptions.NoPermissionError as exc:
            # An ACL written before cancel existed: serve on, without it, and say so once.
            self._cancels_allowed = False
            log.warning("cancel checks are off: this Redis user may not read %s (%s); grant ZMSCORE on it",
                        self.cancel_key, exc)
            return
        for item, score in zip(items, scores):
            if score is None or score < item.enqueued_at:
                continue
            if self.stop(item.entry_id):
                continue  # the next step reports it, and its row says cancelled
            if self.batcher.remove(item.entry_id) or self._unthrottle(item.entry_id):
                self._end_cancelled(item)

    def cancel_cancelled_jobs(self) -> None:
        """Running requests of a job being cancelled stop now (they end with finish_reason cancelled),
        and so do those waiting on their tenant's rate limit."""
        for entry_id, item in list(self.inflight.items()):
            if self.jobs.cancelled(item.request.job_id) and not self.stop(entry_id) and self._unthrottle(entry_id):
                self._end_cancelled(item)

    def _unthrottle(self, entry_id: str) -> bool:
        """Take an entry out of the throttle; False when it does not wait there."""
        item = self.inflight.get(entry_id)
        return bool(self.throttle is not None and item is not None
                    and self.throttle.remove(entry_id, item.request.tenant) is not None)

    def _end_cancelled(self, item: InFlight) -> None:
        """A request cancelled before the engine had it: a cancelled row, no cost."""
        del self.inflight[item.entry_id]
        req = item.request
        self.acks.add_error(item.entry_id, req.id, req.job_id, None, None, attempt=item.attempt,
                            enqueued_at=item.enqueued_at, request=req, finish_reason="cancelled")

    # -- handing back ------------------------------------------------------------------------------
    def unfinished(self) -> list[str]:
        """Entries held here whose row would be this worker's."""
        return [e for e in self.inflight if e not in self.disowned]

    def handback(self, entry_ids: list[str]) -> None:
        """Make unfinished entries claimable at once by another worker, without counting a delivery.

        An entry trimmed from the stream while it ran here cannot be handed back: its request is
        added again as a new entry, which takes over its idempotency record."""
        for qid in entry_ids:
            self.idempotency.forget(qid)
            entry_id, lane = split(qid)
            if qid in self.detached:
                new_id = self.redis.xadd(self.lane_key(lane), encode_entry(self.inflight[qid].request))
                log.warning("entry %s was trimmed while running here: its request is sent again as %s",
                            qid, text(new_id))
                continue
            attempt = self.inflight[qid].attempt
            self.redis.xclaim(
                self.lane_key(lane), self.config.group, HANDBACK_CONSUMER, 0, [entry_id],
                idle=self.config.claim_idle_ms + 1, retrycount=max(0, attempt - 1), justid=True,
            )
        log.info("handed back %d unfinished entries", len(entry_ids))

    # -- lost entries ------------------------------------------------------------------------------
    def ack_lost(self, entry_id: str) -> None:
        """A pending entry whose content was removed from the stream (trimmed) before it had a row.

        If the in-flight hash names its request, that request ends with a ``lost`` error row, unless
        a newer entry carries it (the idempotency record moved on), its row is written already, or a
        registered bulk job sends it again itself; without a name, a dead letter keeps the entry id.
        """
        self.metrics.lost_entries["pending"].inc()
        qid = entry_id
        entry_id, lane = split(qid)
        raw = self.redis.hget(keys.inflight_hash(stream_of(self.config.stream, lane)), entry_id)
        known = None
        try:
            known = json.loads(raw) if raw is not None else None
        except ValueError:
            pass
        if not (isinstance(known, list) and len(known) == 4 and isinstance(known[1], str)):
            log.warning("entry %s was pending but is no longer in the stream (trimmed): its request is lost "
                        "and its id unknown", qid)
            self.dead_letters.send(qid, {}, RequestError(
                errors.LOST, "the entry was removed from the stream (trimmed) while pending; its content is gone"))
            return
        job_id, request_id, tenant, request_type = known
        log.warning("entry %s (request %r, job %r) was pending but is no longer in the stream (trimmed): "
                    "its request is lost", qid, request_id, job_id)
        record_key = self.idempotency.record_key(request_id, job_id, lane)
        record = self.redis.get(record_key)
        if record is not None and (text(record).split(" ", 1)[0] != entry_id or text(record).endswith(" done")):
            self.acks.add_without_row(qid)
            return
        if self.jobs.registered(job_id):  # `mqinfer jobs` sends its lost requests again
            self.acks.add_without_row(qid)
            return
        if record is not None:  # the record is this entry's: copies waiting for it get the lost row
            self.idempotency.adopt(qid, record_key)
        attempt = self.redis.xpending_range(self.lane_key(lane), self.config.group, entry_id, entry_id, 1)
        self.acks.add_error(
            qid, request_id, job_id, errors.LOST,
            "the stream entry was removed (trimmed) while pending, before the request finished; send it again",
            attempt=int(attempt[0]["times_delivered"]) if attempt else 1, enqueued_at=entry_time(entry_id),
            # Stands in for the request whose content is gone: only its labels are read.
            request=Request(id=request_id, prompt="", tenant=tenant, request_type=request_type),
        )

    def check_undelivered_loss(self, lane: str | None = None) -> None:
        """Notice entries removed from the stream before the group read them (XTRIM below the backlog).

        Workers delete only entries they acked, so when no entry older than the group's last
        delivered one is left, entries added minus entries read minus entries left is how many
        were removed unread. One worker reports each gap (a marker key taken with NX).
        """
        stream_key = self.lane_key(lane)
        pipe = self.redis.pipeline(transaction=True)
        pipe.xinfo_stream(stream_key)
        pipe.xinfo_groups(stream_key)
        try:
            stream, groups = pipe.execute()
        except redis.exceptions.ResponseError:
            return  # no stream yet
        group = next((g for g in groups if text(g.get("name")) == self.config.group), None)
        read, added = (group or {}).get("entries-read"), stream.get("entries-added")
        if group is None or read is None or added is None:
            return  # an old server, or a counter the server cannot vouch for
        last = text(group["last-delivered-id"])
        first = stream.get("recorded-first-entry-id")
        length = int(stream.get("length", 0))
        if length and first is not None and entry_order(text(first)) <= entry_order(last):
            return  # pending entries are left at the head: a trim cannot have passed them
        missing = int(added) - int(read) - length
        if missing <= 0 or self._gap_reported.get(lane) == last:
            return
        self._gap_reported[lane] = last
        if not self.redis.set(keys.gap_marker(stream_of(self.config.stream, lane), last), self.consumer, nx=True,
                              ex=GAP_MARKER_TTL_S):
            return  # another worker reported this gap
        self.metrics.lost_entries["undelivered"].inc(missing)
        log.error("%d entries after %s were removed from %s before any worker read them (XTRIM or MAXLEN "
                  "below the backlog?): their requests are lost and their ids unknown", missing, last,
                  stream_key)
        self.dead_letters.record_gap({
            "entry_id": last, "error_code": errors.LOST, "count": missing, "worker": self.consumer,
            "error": f"{missing} entries after {last} were removed from the stream before any worker read them",
        })
