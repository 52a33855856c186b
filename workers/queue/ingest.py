"""Ingest: what a worker reads from its request stream, and how much.

It reads what the engine can start soon plus a short waiting queue (``XREADGROUP`` with a COUNT
bounded by free capacity and by ``waiting_bound``, and no more than a fair share of the backlog
among the live workers), and takes over
the entries of dead workers (``XAUTOCLAIM`` of entries idle longer than ``--claim-idle-ms``).
Each entry is decoded and validated: a bad one ends with an error row, or goes to the dead
letters when it has no usable id; a duplicate of a request another entry carries is not computed
(:mod:`.idempotency`); one delivered more than ``--max-deliveries`` times ends with an error row;
the rest go to the batcher, except those of a rate-limited tenant (``--tenant-limits``), which
wait in the throttle (:mod:`.throttle`) until their tenant's bucket gives them their tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import redis

from mqinfer.scheduler.request import SamplingParams
from mqinfer.schemas import errors, keys
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import Request, to_sampling_kwargs
from mqinfer.schemas.stream import decode_entry
from mqinfer.workers.queue.acks import Acks
from mqinfer.workers.queue.context import QueueContext
from mqinfer.workers.queue.consumer_group import (  # noqa: F401  (the group's names, as before)
    HANDBACK_CONSUMER, LIVE_CONSUMER_MS, DeadLetters, announced, ensure_group, is_notice, recover_job_id,
)
from mqinfer.workers.engine.inputs import EngineInputError
from mqinfer.workers.queue.entries import InFlight, entry_time, text
from mqinfer.workers.queue.last_try import LastTries
from mqinfer.workers.queue.lanes import Lane, LaneSet, expected_service, lane_of, qualify, split
from mqinfer.workers.tenant_limits import request_tokens

log = logging.getLogger("mqinfer.worker")

# How often a worker whose engine and waiting queue are full looks for lanes with nothing waiting
# here (Ingest._read_newcomers).
NEWCOMER_CHECK_S = 0.05
# A Redis server ends a blocked read that no arrival woke at its next timer tick, not at the
# timeout asked for: every 100 ms at the default `hz 10` (a BLOCK of 5 ms returns after 100). A
# worker that blocked on the server for its batcher's 10 ms max wait would start the batch up to
# 90 ms late; waits shorter than two ticks are taken here instead, in naps between reads that do
# not block.
SERVER_TICK_S = 0.1
NAP_S = 0.002


class Ingest:
    def __init__(self, context: QueueContext, *, engine, batcher, ownership, acks: Acks,
                 dead_letters: DeadLetters) -> None:
        config = context.config
        self.redis = context.redis
        self.config = config
        self.consumer = context.consumer
        self.stream_key = keys.request_stream(config.stream)
        self.engine = engine
        self.batcher = batcher
        self.ownership = ownership
        self.idempotency = context.idempotency
        self.acks = acks
        self.replies = context.replies
        self.dead_letters = dead_letters
        self.jobs = context.jobs
        self.metrics = context.metrics
        self.budget_guard = context.budget_guard
        self.throttle = context.throttle
        self.clock = context.clock
        self.last_tries = LastTries(context.redis, config.stream, context.consumer, config.max_deliveries)
        # Reads may block while the worker has nothing to do; a test that drives the loop by hand
        # turns this off.
        self.block_reads = True
        # Seconds spent blocked in XREADGROUP (waiting for entries is not work).
        self.blocked_s = 0.0
        self.last_accept = float("-inf")
        self._last_autoclaim = 0.0
        self._last_newcomer_check = float("-inf")
        # Streams on which the arrival watch saw requests with latency targets (expect_arrival).
        self._arrivals: set[str] = set()
        weights = engine.scheduler_config
        self.lanes = LaneSet(context.redis, config.stream, config.group, enabled=config.lanes != "none",
                             max_lanes=config.max_lanes, weight_of=weights.weight_of, clock=context.clock)
        # Reads that block span the lanes in one command, except in a Redis Cluster (one command
        # cannot span slots): there they block on the plain stream for a short while at most.
        self.cluster = config.redis_cluster

    def ensure_group(self) -> None:
        ensure_group(self.redis, self.stream_key, self.config.group)

    # -- how much to read ------------------------------------------------------------------------
    @property
    def waiting_bound(self) -> int:
        """Requests this worker keeps waiting (in its scheduler and batcher) while its engine is
        full: reading goes on up to this many, so that other tenants' requests queued behind one
        tenant's flood reach the scheduler, whose fair share can then pick them ahead of it.
        ``max(--max-num-seqs, 2 x --max-batch)``: about one more batch of running requests."""
        return max(self.engine.scheduler_config.max_num_seqs, 2 * self.config.max_batch)

    @property
    def throttled_bound(self) -> int:
        """Requests of rate-limited tenants this worker holds waiting on their limits at most:
        ``4 x waiting_bound``. Reading goes on past a limited tenant's requests so that other
        tenants' requests behind them are served; beyond this many held, it stops (memory stays
        bounded, and the rest of a flood waits in the stream, where other workers can take it)."""
        return 4 * self.waiting_bound

    def _room(self) -> tuple[int, int]:
        """(how many entries to read at most now, how many of those the engine could start at once).

        The engine can start requests only while none waits in its scheduler (one waiting shows
        that it is full, by sequences or by KV blocks); beyond those, the worker fills its waiting
        queue up to ``waiting_bound``. At most ``--max-batch`` per read; nothing while the throttle
        holds ``throttled_bound`` requests.
        """
        if self.throttle is not None and len(self.throttle) >= self.throttled_bound:
            return 0, 0
        engine = self.engine
        queued = len(self.batcher)
        startable = 0 if engine.num_waiting else max(0, engine.free_capacity() - queued)
        buffered = max(0, self.waiting_bound - engine.num_waiting - queued)
        return min(max(startable, buffered), self.config.max_batch), startable

    def _fair_share(self, room: int, startable: int) -> int:
        """How many unread entries to take now: an even share of all outstanding work (unread plus
        in flight) among the live workers, less what this one holds. While the engine can start
        requests at once (``startable``): at least one, so that no backlog waits while this worker
        has room, unless another live worker has never been given an entry (it is starting, or
        waiting on the stream): that one takes the rest; and with nothing unread, ``room`` (new
        arrivals go to the blocked readers in turn). Entries that would only wait here are taken
        within the share alone, so a worker whose engine is full never holds more than its share
        of a backlog that other workers could start."""
        if room <= 1 and startable:
            return room
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_groups(self.stream_key)
        pipe.xinfo_consumers(self.stream_key, self.config.group)
        try:
            groups, consumers = pipe.execute()
        except redis.exceptions.ResponseError:  # no stream or group yet: the read below recreates it
            return room
        group = next((g for g in groups if text(g["name"]) == self.config.group), None)
        if group is None:
            return room
        return self._share(room, startable, int(group.get("lag") or 0), int(group["pending"]), consumers)

    def _share(self, room: int, startable: int, lag: int, pending: int, consumers) -> int:
        """The fair share's arithmetic (see :meth:`_fair_share`), from the group's unread (lag) and
        pending counts over every lane and the plain stream's consumers."""
        if not lag and startable:  # nothing unread, or the server cannot tell
            return room
        names = {text(c["name"]): c for c in consumers}
        others = [c for name, c in names.items()
                  if name not in (HANDBACK_CONSUMER, self.consumer) and c["idle"] < LIVE_CONSUMER_MS]
        live = len(others) + 1
        share = -(-(lag + pending) // live) - len(self.ownership)
        # Servers before Redis 7.2 report no "inactive" (never given an entry: -1).
        newcomer = any(c.get("inactive") == -1 for c in others)
        return max(1 if startable and not newcomer else 0, min(room, share))

    def _idle(self) -> bool:
        """Nothing to step and nothing to flush: the loop may wait for arrivals."""
        return self.block_reads and not self.engine.has_unfinished() and not self.acks.rows_buffered

    def _until_due(self) -> float | None:
        """Seconds until something held here is due: the batcher's release (its max wait) or the
        throttle's next retry; None when nothing is."""
        wait = self.batcher.time_until_release(engine_idle=True)
        if self.throttle is not None:
            retry = self.throttle.time_until_retry(self.clock())
            if retry is not None:
                wait = retry if wait is None else min(wait, retry)
        return wait

    def _block_ms(self) -> int | None:
        """How long XREADGROUP may block on the server: never while the engine has work to step,
        and only so long that the server's late timeout (:data:`SERVER_TICK_S`) still ends it
        before the next thing held here is due; the rest of such a wait is napped here
        (:meth:`_nap`)."""
        if not self._idle():
            return None
        due = self._until_due()
        if due is not None:
            return int(1000 * (due - SERVER_TICK_S)) if due >= 2 * SERVER_TICK_S else None
        return int(1000 * self._idle_cap_s())

    def _idle_cap_s(self) -> float:
        """The longest wait for arrivals with nothing due: a second, or the idle exit's time."""
        cap = 1.0
        if self.config.idle_exit_s is not None:
            cap = min(cap, max(0.001, self.config.idle_exit_s))
        return cap

    def _nap(self) -> None:
        """After a read that did not block and found nothing, while something held here comes due
        within a server tick: sleep a short slice here, then the loop reads again (an arrival waits
        at most :data:`NAP_S` to join the batch)."""
        if not self._idle():
            return
        due = self._until_due()
        if due is None or due <= 0:
            return
        t0 = time.perf_counter()
        time.sleep(min(due, NAP_S))
        self.blocked_s += time.perf_counter() - t0

    # -- reading ---------------------------------------------------------------------------------
    def read(self, now: float) -> None:
        """Take what the engine can start soon: dead workers' entries first (every claim tick),
        then new ones. Streams where requests with latency targets arrived come first."""
        if self._arrivals:
            self._read_arrivals(now)
        room, startable = self._room()
        if room <= 0:
            if not (self.lanes.multi and self._read_newcomers(now)):
                self._pause()
            return
        if now - self._last_autoclaim >= min(self.config.claim_idle_ms / 2000.0, 5.0):
            self._last_autoclaim = now
            for lane in self.lanes:
                self.ownership.check_undelivered_loss(lane.name)
            claimed = self._autoclaim(room)
            room -= claimed
            startable = max(0, startable - claimed)
            if room <= 0:
                return
        self.lanes.refresh(now)
        if self.lanes.multi:
            self._read_lanes(room, startable)
            return
        room = self._fair_share(room, startable)
        if room <= 0:
            return
        block = self._block_ms()
        t_read = time.perf_counter()
        try:
            response = self.redis.xreadgroup(
                self.config.group, self.consumer, {self.stream_key: ">"}, count=room, block=block
            )
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):  # the stream or group was deleted under us: recreate
                self.ensure_group()
                return
            raise
        finally:
            if block is not None:
                self.blocked_s += time.perf_counter() - t_read
        if response:
            self._take(response)
        elif block is None:
            self._nap()

    def _take(self, response) -> None:
        """Accept what an XREADGROUP over one or more lanes returned."""
        taken: dict[str, dict] = {}
        lane_by_key = {lane.key: lane.name for lane in self.lanes}
        for key, entries in response or []:
            lane = lane_by_key.get(text(key))
            for entry_id, fields in entries:
                qid = qualify(text(entry_id), lane)
                if qid in self.ownership or qid in taken:
                    # Delivered again while running here (a group rewound with XGROUP SETID, a
                    # server restarted from an append-only file that lost its last second).
                    continue
                taken[qid] = fields
        self.accept_many([(qid, fields, 1, False) for qid, fields in taken.items()])
        new = list(taken)
        if new:
            self.ownership.apply_cancels([e for e in new if e in self.ownership])

    def _read_lanes(self, room: int, startable: int) -> None:
        """A read over the plain stream and the lanes: one look at every lane's unread and pending
        counts, the fair share of them for this worker (as on one stream), shared out among the
        lanes by their counters (:class:`LaneSet`), then one pipelined read of that many from each.
        With nothing unread anywhere, one read that blocks on all the lanes."""
        lanes = list(self.lanes)
        consumers, total_unread, total_pending = self._look_at(lanes)
        if total_unread == 0:
            self._block_on_lanes(room, lanes)
            return
        share = self._share(room, startable, total_unread, total_pending, consumers)
        if share > 0:
            self._read_plan(self.lanes.share_out(share))

    def expect_arrival(self, stream_keys: Iterable[str]) -> None:
        """Requests with latency targets arrived on these streams (the arrival watch saw them,
        workers/queue/arrivals.py): the next read takes from them first, up to ``--max-batch``
        entries each, whatever this worker's share of the backlog, and looks at the lanes with
        nothing waiting here at once rather than ``NEWCOMER_CHECK_S`` after its last look."""
        self._arrivals.update(stream_keys)
        self._last_newcomer_check = float("-inf")

    def _read_arrivals(self, now: float) -> None:
        wanted, self._arrivals = self._arrivals, set()
        if not wanted <= {lane.key for lane in self.lanes}:
            self.lanes.refresh(now, force=True)  # a lane announced during the step
        plan = [(lane, self.config.max_batch) for lane in self.lanes if lane.key in wanted]
        missing = self._read_plan(plan)
        if missing:  # a new lane's group was just made: read it now rather than after the next step
            self._read_plan(missing)

    def _read_newcomers(self, now: float) -> bool:
        """The engine is full and its waiting queue at its bound, yet a lane with nothing waiting
        here may still be read: up to an even part of the bound per lane (at most ``--max-batch``),
        and no more than an even share of its own backlog among the live workers. Without this,
        behind another lane's flood its requests would reach the scheduler (whose fair share of the
        running slots can start them at once) one at a time, as the flood's waiting requests drain.
        Looked at every ``NEWCOMER_CHECK_S`` at most. Returns whether anything was read."""
        if now - self._last_newcomer_check < NEWCOMER_CHECK_S:
            return False
        self._last_newcomer_check = now
        self.lanes.refresh(now)
        waiting_here = {lane_of(qid) for qid, item in self.ownership.inflight.items() if item.started_at is None}
        absent = [lane for lane in self.lanes if lane.name not in waiting_here]
        if not waiting_here or not absent:
            return False
        consumers, unread, pending = self._look_at(absent)
        if unread == 0:
            return False
        live = 1 + sum(1 for c in consumers if text(c["name"]) not in (HANDBACK_CONSUMER, self.consumer)
                       and c["idle"] < LIVE_CONSUMER_MS)
        allowance = max(1, min(self.config.max_batch, self.waiting_bound // len(list(self.lanes))))
        share = min(allowance, -(-(unread + pending) // live))
        before = len(self.ownership)
        self._read_plan(self.lanes.share_out(share, only={lane.name for lane in absent}))
        return len(self.ownership) > before

    def _look_at(self, lanes: list[Lane]) -> tuple[list, int, int]:
        """(the plain stream's consumers, unread entries, pending entries) over ``lanes``, each
        lane's unread count given to the lane set (:meth:`LaneSet.observe`)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xinfo_consumers(self.stream_key, self.config.group)
        for lane in lanes:
            pipe.xinfo_groups(lane.key)
            pipe.xlen(lane.key)
        replies = pipe.execute(raise_on_error=False)
        consumers = replies[0] if not isinstance(replies[0], Exception) else []
        unread: dict[str | None, int] = {}
        total_unread = total_pending = 0
        for n, lane in enumerate(lanes):
            groups, length = replies[1 + 2 * n], replies[2 + 2 * n]
            group = None if isinstance(groups, Exception) else next(
                (g for g in groups if text(g["name"]) == self.config.group), None)
            if group is None:  # a lane whose group is gone (or not yet made): made at the stream's start
                self.lanes.ensure_group(lane)
                count = 0 if isinstance(length, Exception) else int(length)
                pending = 0
            else:
                pending = int(group.get("pending") or 0)
                lag = group.get("lag")
                count = int(lag) if lag is not None else max(0, int(length) - pending)
            unread[lane.name] = count
            total_unread += count
            total_pending += pending
        self.lanes.observe(unread)
        return consumers, total_unread, total_pending

    def _read_plan(self, plan: list[tuple[Lane, int]]) -> list[tuple[Lane, int]]:
        """One pipelined read of so many entries from each lane; returns the part of the plan whose
        lanes had no group (made now, at the stream's start)."""
        if not plan:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for lane, count in plan:
            pipe.xreadgroup(self.config.group, self.consumer, {lane.key: ">"}, count=count)
        replies = pipe.execute(raise_on_error=False)
        missing = []
        for (lane, count), reply in zip(plan, replies):
            if isinstance(reply, redis.exceptions.ResponseError) and "NOGROUP" in str(reply):
                self.lanes.ensure_group(lane)
                missing.append((lane, count))
            elif isinstance(reply, Exception):
                raise reply
            else:
                self._take(reply)
        return missing

    def _block_on_lanes(self, room: int, lanes: list[Lane]) -> None:
        """Nothing unread: wait for the first arrival on any lane (a new lane's notice arrives on
        the plain stream, which is among them)."""
        block = self._block_ms()
        if block is None:
            self._nap()
            return
        streams = {lane.key: ">" for lane in lanes}
        if self.cluster:
            streams = {self.stream_key: ">"}
            block = min(block, 100)
        t_read = time.perf_counter()
        try:
            response = self.redis.xreadgroup(self.config.group, self.consumer, streams, count=room, block=block)
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):
                for lane in lanes:
                    self.lanes.ensure_group(lane)
                return
            raise
        finally:
            self.blocked_s += time.perf_counter() - t_read
        self._take(response)

    def _pause(self) -> None:
        """Nothing may be read: with nothing to step either (only rate-limited requests held), wait
        until the throttle's next retry instead of turning the loop at full speed."""
        if not self._idle() or self.throttle is None or not len(self.throttle):
            return
        due = self._until_due()
        if due is not None and due <= 0:
            return
        t0 = time.perf_counter()
        time.sleep(self._idle_cap_s() if due is None else min(due, self._idle_cap_s()))
        self.blocked_s += time.perf_counter() - t0

    def recover_own_pending(self) -> None:
        """Entries already pending under this consumer name (a restart with a fixed --consumer)."""
        self.lanes.refresh(self.clock(), force=True)
        for lane in self.lanes:
            try:
                response = self.redis.xreadgroup(self.config.group, self.consumer, {lane.key: "0"}, count=10_000)
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    continue
                raise
            for _key, entries in response or []:
                for entry_id, fields in entries:
                    qid = qualify(text(entry_id), lane.name)
                    if fields:
                        self.accept(qid, fields, attempt=self.delivery_count(qid), redelivered=True)
                    else:
                        self.ownership.ack_lost(qid)

    def delivery_count(self, qid: str) -> int:
        entry_id, lane = split(qid)
        info = self.redis.xpending_range(self.ownership.lane_key(lane), self.config.group, entry_id, entry_id, 1)
        return int(info[0]["times_delivered"]) if info else 1

    def _autoclaim(self, room: int) -> int:
        """Take over entries idle longer than --claim-idle-ms (their worker is presumed dead), from
        every lane."""
        claimed = 0
        for lane in self.lanes:
            if room - claimed <= 0:
                break
            claimed += self._autoclaim_lane(lane, room - claimed)
        return claimed

    def _autoclaim_lane(self, lane: Lane, room: int) -> int:
        try:
            result = self.redis.xautoclaim(
                lane.key, self.config.group, self.consumer, self.config.claim_idle_ms,
                start_id=lane.claim_cursor, count=room,
            )
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc):
                self.lanes.ensure_group(lane)
                return 0
            raise
        # The server scans at most COUNT*10 pending entries per call: keep the cursor so that a
        # long pending list is walked in full over successive calls.
        lane.claim_cursor = text(result[0]) if result else "0-0"
        entries = result[1] if len(result) > 1 else []
        deleted = result[2] if len(result) > 2 else []
        written = self.acks.holds() if deleted else set()
        for entry_id in deleted:  # pending, but trimmed from the stream: its content is gone
            qid = qualify(text(entry_id), lane.name)
            if qid in written:
                continue  # its row is written, only the ack is to come
            if qid in self.ownership:  # running here: the scan dropped it from our pending list
                self.ownership.trimmed_while_running(qid)
                continue
            self.ownership.ack_lost(qid)
        for entry_id, fields in entries:
            qid = qualify(text(entry_id), lane.name)
            if qid in self.ownership:
                continue
            self.metrics.redeliveries.inc()
            self.accept(qid, fields, attempt=self.delivery_count(qid), redelivered=True)
        return len(entries)

    # -- one entry -------------------------------------------------------------------------------
    def accept(self, entry_id: str, fields: dict, attempt: int, redelivered: bool = False) -> None:
        """Decode and validate one entry; a bad one becomes an error row or a dead letter.

        A redelivered request with a reply stream first gets a ``restart`` message there, so its
        consumer drops what an earlier worker sent.
        """
        self.accept_many([(entry_id, fields, attempt, redelivered)])

    def accept_many(self, entries: list[tuple[str, dict, int, bool]]) -> None:
        """``accept`` each (entry id, fields, attempt, redelivered), in order, with their records
        claimed in one round trip (a read's worth of entries costs one, not one each)."""
        decoded = []
        for entry_id, fields, attempt, redelivered in entries:
            request = self._decode(entry_id, fields, attempt)
            if request is not None:
                decoded.append((entry_id, fields, attempt, redelivered, request))
        claims = self.idempotency.claim_many([(d[0], d[4]) for d in decoded])
        for (entry_id, fields, attempt, redelivered, request), claim in zip(decoded, claims):
            self._accept_claimed(entry_id, fields, attempt, redelivered, request, claim)

    def _decode(self, entry_id: str, fields: dict, attempt: int) -> Request | None:
        """The entry's request, or None: a lane's notice is taken in, a bad entry becomes an error
        row or a dead letter."""
        self.last_accept = self.clock()
        if is_notice(fields):  # a producer registered a new lane: read it from now on
            self.lanes.refresh(self.last_accept, force=True)
            self.acks.add_without_row(entry_id)
            return None
        try:
            return decode_entry(fields, max_entry_bytes=self.config.max_entry_bytes)
        except RequestError as exc:
            if exc.request_id is None:
                self.dead_letters.send(entry_id, fields, exc)
            else:
                self.acks.add_error(entry_id, exc.request_id, recover_job_id(fields), exc.code, exc.message,
                                    attempt=attempt, enqueued_at=entry_time(entry_id))
            return None

    def _accept_claimed(self, entry_id: str, fields: dict, attempt: int, redelivered: bool, request: Request,
                        claim) -> None:
        enqueued_at = entry_time(entry_id)
        if claim.duplicate:
            if claim.outcome == "conflict":
                self.dead_letters.send(entry_id, fields, self.idempotency.conflict_error(request, claim))
            else:
                self.acks.add_without_row(entry_id)
            self.idempotency.answer(entry_id, request, claim)
            return
        if redelivered:
            self.replies.restart(request, attempt)
        refused = self._refusal(entry_id, request, attempt)
        if refused is not None:
            code, message, finish_reason = refused
            self.acks.add_error(entry_id, request.id, request.job_id, code, message, attempt=attempt,
                                enqueued_at=enqueued_at, request=request, finish_reason=finish_reason)
            return
        try:
            messages = (
                [{"role": m.role, "content": m.content} for m in request.messages] if request.messages else None
            )
            limit = self.config.max_tokens_limit
            if limit is not None and request.max_tokens > limit:
                raise ValueError(f"max_tokens {request.max_tokens} is over this worker's limit of {limit} "
                                 "(--max-tokens-limit) - at `$.max_tokens`")
            prompt_ids = self.engine.encode_prompt(request.prompt, request.prompt_token_ids, messages)
            sampling = SamplingParams(**to_sampling_kwargs(request))
        except EngineInputError as exc:
            self.acks.add_error(entry_id, request.id, request.job_id, exc.code, exc.message,
                                attempt=attempt, enqueued_at=enqueued_at, request=request)
            return
        except ValueError as exc:
            self.acks.add_error(entry_id, request.id, request.job_id, errors.INVALID_REQUEST, str(exc),
                                attempt=attempt, enqueued_at=enqueued_at, request=request)
            return
        self.ownership.take(InFlight(entry_id, request, attempt, enqueued_at, prompt_token_ids=prompt_ids,
                                     sampling=sampling))
        self.lanes.charge(split(entry_id)[1], request.tenant, expected_service(len(prompt_ids), request.max_tokens))
        if self.throttle is not None and self.throttle.limits_tenant(request.tenant):
            tokens = request_tokens(len(prompt_ids), request.max_tokens, self.engine.scheduler_config.max_model_len)
            self.throttle.add(entry_id, request.tenant, tokens, request.deadline)
        else:
            self.batcher.add(entry_id)

    def _refusal(self, entry_id: str, request: Request,
                 attempt: int) -> tuple[str | None, str | None, str] | None:
        """Why a valid request ends before it runs: (error code, message, finish reason), or None."""
        over = self.last_tries.refusal(entry_id, attempt)
        if over is not None:
            return errors.MAX_DELIVERIES_EXCEEDED, over, "error"
        if self.jobs.cancelled(request.job_id):
            return None, None, "cancelled"
        if self.config.enforce_budgets:
            refused = self.budget_guard.exceeded(request.tenant, job_id=request.job_id, metadata=request.metadata)
            if refused is not None:
                return errors.BUDGET_EXCEEDED, refused, "error"
        info = self.engine.info
        if request.model is not None and request.model not in (info.name, info.model_id):
            return (errors.MODEL_MISMATCH,
                    f"model: request asks for {request.model!r} but this worker serves {info.name!r}", "error")
        return None
