"""Idempotency: one computation per request (``job_id``, ``id``), however often producers send it.

Each accepted request gets an idempotency record (first entry id, content hash, whether it was
computed) with a time to live, taken atomically by a script. While the first entry is live or
computed, a second entry with the same content is acked without computing it again and one with
different content is refused to the dead letters; content is compared without the fields that
only say where and when to deliver (``reply_to``, ``priority``, ``deadline``), so a retry from
another client is the same request. A copy with a reply stream is answered there: with the first
copy's final row (kept with the record when the first copy had a reply stream too), once that
row is written if it still runs, or with a ``duplicate_id`` error row (never written) if its
content differs. Once the first is gone without a result (lost, cancelled, failed), a new copy
takes over. The stored final of a request with ``n`` > 1 choices is the list of every choice's row.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass

import msgspec
from redis.exceptions import NoScriptError

from mqinfer.schemas import errors, keys
from mqinfer.schemas.connection import is_cluster
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import ResultRow
from mqinfer.workers.queue.billing import Billing
from mqinfer.workers.queue.entries import text
from mqinfer.workers.queue.lanes import split, stream_of
from mqinfer.workers.queue.replies import Replies

log = logging.getLogger("mqinfer.worker")

# Takes a request's idempotency record for an entry, atomically. KEYS: record, in-flight hash,
# request stream, stored final row, waiting reply streams. ARGV: entry id, content hash, ttl
# seconds, in-flight value, the entry's reply stream ('' for none), MAX_WAITERS. The record holds
# "<entry id> <content hash> <run|done>"; `done` once the request has its result (a row that
# finished `stop` or `length`). Returns {outcome, first entry id, state, stored row}; outcome is
# `new`, `redelivery` (the same entry again), `takeover` (the first entry is gone without a result:
# lost, cancelled, expired or failed, so the request may be sent again), `same` (a duplicate of a
# live or computed request) or `conflict` (different content than a live or computed one). A `same`
# copy of a computed request gets the stored final row (if any) to answer with; one of a live
# request adds its reply stream to the waiting ones (a JSON list, at most MAX_WAITERS), answered
# when the first copy's row is written (the ack reads and clears them in one transaction with the
# record's change to `done`). Only GET and SET touch the row and waiter keys: the worker's ACL
# user may not DEL (ops/acl), so a stale key is cleared by letting it expire at once.
_CLAIM_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
local mine = ARGV[1] .. ' ' .. ARGV[2] .. ' run'
if cur then
  local entry, digest, state = string.match(cur, '^(%S+) (%S+) (%S+)$')
  if entry == ARGV[1] then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
    return {'redelivery', entry, state, ''}
  end
  if state == 'done' or #redis.call('XRANGE', KEYS[3], entry, entry) > 0 then
    if digest ~= ARGV[2] then return {'conflict', entry, state, ''} end
    if state == 'done' then
      return {'same', entry, state, redis.call('GET', KEYS[4]) or ''}
    end
    if ARGV[5] ~= '' then
      local raw = redis.call('GET', KEYS[5])
      local waiting = {}
      if raw and raw ~= '' then waiting = cjson.decode(raw) end
      if #waiting < tonumber(ARGV[6]) then
        table.insert(waiting, ARGV[5])
        redis.call('SET', KEYS[5], cjson.encode(waiting), 'EX', ARGV[3])
      end
    end
    return {'same', entry, state, ''}
  end
  redis.call('SET', KEYS[1], mine, 'EX', ARGV[3])
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
  return {'takeover', entry, state, ''}
end
redis.call('SET', KEYS[1], mine, 'EX', ARGV[3])
for i = 4, 5 do  -- left by an expired record of the same (job_id, id): not this request's
  if redis.call('GET', KEYS[i]) then redis.call('SET', KEYS[i], '', 'PX', 1) end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
return {'new', '', 'run', ''}
"""
# Fields that say where, when or in what order to deliver a result, not what to compute: a copy
# of a request that differs only in these is the same request (a retry from another client).
_DELIVERY_FIELDS = {"reply_to": None, "priority": 0, "deadline": None}
# Copies of one running request whose reply streams are remembered, at most.
MAX_WAITERS = 100
# Deterministic (sorted map keys), so equal requests hash equal however the producer ordered them.
_CONTENT_ENCODER = msgspec.msgpack.Encoder(order="deterministic")
_ROW_ENCODER = msgspec.json.Encoder()
_ROW_DECODER = msgspec.json.Decoder(ResultRow)
_ROWS_DECODER = msgspec.json.Decoder(list[ResultRow])


def final_row_key(record: str) -> str:
    """The stored final row of a computed request (same hash tag as its record)."""
    return record + ":row"


def waiters_key(record: str) -> str:
    """Reply streams of copies that arrived while the first copy ran (same hash tag as its record)."""
    return record + ":wait"


def waiting_reply_streams(raw) -> list[str]:
    """The reply streams of a waiter key's value (a JSON list), each once, in order."""
    if not raw:
        return []
    try:
        streams = json.loads(raw)
    except ValueError:
        return []
    if not isinstance(streams, list):
        return []
    return list(dict.fromkeys(s for s in streams if isinstance(s, str) and s.startswith(keys.REPLY_PREFIX)))


def content_digest(request: Request) -> str:
    """A request's content hash for the idempotency record: equal for copies that differ only in
    delivery fields, however the producer ordered map keys."""
    bare = msgspec.structs.replace(request, **_DELIVERY_FIELDS)
    if request.logit_bias:
        # A deterministic encoding sorts map keys as text: token ids become their JSON spelling.
        bare = msgspec.structs.replace(bare, logit_bias={str(t): b for t, b in request.logit_bias.items()})
    return hashlib.sha256(_CONTENT_ENCODER.encode(bare)).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Claim:
    """What taking a request's record said: ``outcome`` (see the script above), the first entry
    that carried the request, that entry's state and its stored final row (``same`` copies of a
    computed request)."""

    outcome: str
    first: str = ""
    state: str = "run"
    stored: bytes | str = ""

    @property
    def duplicate(self) -> bool:
        """Another entry carries this request: this one is not computed."""
        return self.outcome in ("same", "conflict")


class Idempotency:
    """The records of the requests this worker took: entry id -> (record key, content hash)."""

    def __init__(self, redis_client, stream: str, *, ttl_s: float, replies: Replies, billing: Billing,
                 metrics) -> None:
        self.redis = redis_client
        self.stream = stream
        self.stream_key = keys.request_stream(stream)
        self.inflight_key = keys.inflight_hash(stream)
        self.ttl_s = ttl_s
        self.replies = replies
        self.billing = billing
        self.metrics = metrics
        self.records: dict[str, tuple[str, str]] = {}
        self._claim = redis_client.register_script(_CLAIM_SCRIPT)

    def record_key(self, request_id: str, job_id: str | None, lane: str | None = None) -> str:
        """A request's record, in the slot of the lane its entries come in (records, like the
        in-flight hash, change in the same transaction as the lane's acks)."""
        return keys.idempotency_key(stream_of(self.stream, lane), job_id, request_id)

    def claim(self, entry_id: str, request: Request) -> Claim:
        """Take the request's record for this entry (and name the request in the in-flight hash).

        ``entry_id`` is the worker's qualified id (``<id>@<lane>`` for a lane's entry); the record
        holds the id within the lane's stream. Without records (a time to live of 0) every entry
        is new."""
        return self.claim_many([(entry_id, request)])[0]

    def claim_many(self, items: list[tuple[str, Request]]) -> list[Claim]:
        """``claim`` for each (entry id, request), in order, in one round trip: the scripts run one
        after another on the server, so a second copy of a request in the same read finds the
        first one's record, as if claimed one at a time. (On a cluster, whose pipelines do not
        carry scripts, one round trip each.)"""
        if not self.ttl_s:
            return [Claim("new") for _ in items]
        calls = [self._claim_call(entry_id, request) for entry_id, request in items]
        if is_cluster(self.redis):
            results = [self._claim(keys=k, args=a) for k, a, _, _ in calls]
        else:
            results = self._claim_pipelined([(k, a) for k, a, _, _ in calls])
        return [self._claimed(entry_id, request, record, digest, result)
                for (entry_id, request), (_, _, record, digest), result in zip(items, calls, results)]

    def _claim_pipelined(self, calls: list[tuple[list[str], list]]) -> list:
        """Run the claim script for each (keys, args) in one pipeline of ``EVALSHA``.

        redis-py's own script pipelining asks ``SCRIPT EXISTS`` first, which the worker's ACL user
        may not run; instead a call the server answers with ``NOSCRIPT`` (a restarted or flushed
        server) did not run, so the script is loaded with ``SCRIPT LOAD`` and those calls run again,
        in their order, after the ones that did."""
        def send(indices: list[int]) -> list:
            pipe = self.redis.pipeline(transaction=False)
            for i in indices:
                k, a = calls[i]
                pipe.evalsha(self._claim.sha, len(k), *k, *a)
            return pipe.execute(raise_on_error=False)

        results = send(list(range(len(calls))))
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            self.redis.script_load(_CLAIM_SCRIPT)  # the same SHA: the script's own hash
            for i, r in zip(missing, send(missing)):
                results[i] = r
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    def _claim_call(self, entry_id: str, request: Request) -> tuple[list[str], list, str, str]:
        """The claim script's keys and arguments for one entry, its record key and content digest."""
        raw_id, lane = split(entry_id)
        lane_stream = stream_of(self.stream, lane)
        record = self.record_key(request.id, request.job_id, lane)
        digest = content_digest(request)
        known = json.dumps([request.job_id, request.id, request.tenant, request.request_type])
        return ([record, keys.inflight_hash(lane_stream), keys.request_stream(lane_stream), final_row_key(record),
                 waiters_key(record)],
                [raw_id, digest, max(1, math.ceil(self.ttl_s)), known, request.reply_to or "", MAX_WAITERS],
                record, digest)

    def _claimed(self, entry_id: str, request: Request, record: str, digest: str, result) -> Claim:
        """What one claim script's reply means, with its logs and counts."""
        outcome, first, state, stored = result
        claim = Claim(text(outcome), text(first), text(state), stored)
        if not claim.duplicate:
            if claim.outcome == "takeover":
                log.info("request %r (job %r): entry %s takes over from %s, which is gone without a row",
                         request.id, request.job_id, entry_id, claim.first)
            self.records[entry_id] = (record, digest)
        elif claim.outcome == "same":
            self.metrics.duplicates["same"].inc()
            log.info("entry %s repeats request %r (job %r) of entry %s: computed once", entry_id, request.id,
                     request.job_id, claim.first)
        else:
            self.metrics.duplicates["conflict"].inc()
        return claim

    def conflict_error(self, request: Request, claim: Claim) -> RequestError:
        """Why a copy with other content than the first is refused (its dead letter's reason)."""
        return RequestError(errors.DUPLICATE_ID, (
            f"id {request.id!r} (job_id {request.job_id!r}) was already submitted with different content "
            f"(entry {claim.first}); a request is identified by (job_id, id) - at `$.id`"), request.id)

    def answer(self, entry_id: str, request: Request, claim: Claim) -> None:
        """Answer a duplicate copy on its reply stream, so its client does not wait in vain: a copy
        of a computed request gets the first copy's final row, a conflicting copy a ``duplicate_id``
        error row (neither is written). A copy of a running request waits in the record's waiter
        list and is answered when the first copy's row is acked."""
        if request.reply_to is None:
            return
        if claim.outcome == "conflict":
            row = self.billing.duplicate_answer(entry_id, request, self.conflict_error(request, claim).message)
        elif claim.state == "done":
            rows = self._stored_rows(request, claim.stored)
            if rows:
                self.replies.final(request.reply_to, rows[0], rows if len(rows) > 1 else None)
                return
            # Computed without a reply stream of its own, so its row was not kept.
            row = self.billing.duplicate_answer(entry_id, request, (
                f"id {request.id!r} (job_id {request.job_id!r}) was already computed (entry {claim.first}); "
                "its row is in the results dataset and is not sent again - at `$.id`"))
        else:
            return
        self.replies.final(request.reply_to, row)

    @staticmethod
    def _stored_rows(request: Request, stored) -> list[ResultRow]:
        """The stored final: one row, or every choice's rows (a list) for a request with n > 1 choices."""
        if not stored:
            return []
        try:
            raw = stored.decode() if isinstance(stored, bytes) else stored
            if raw.lstrip().startswith("["):
                return _ROWS_DECODER.decode(raw)
            return [_ROW_DECODER.decode(raw)]
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            log.warning("stored final row of request %r (job %r) is unreadable: %s", request.id,
                        request.job_id, exc)
            return []

    def adopt(self, entry_id: str, record: str) -> None:
        """Hold a record this worker did not take (a lost entry's), so that copies waiting for it
        get the row this worker writes instead."""
        self.records[entry_id] = (record, "")

    def forget(self, entry_id: str) -> None:
        self.records.pop(entry_id, None)

    def done_elsewhere(self, entry_ids: list[str]) -> set[str]:
        """Those of ``entry_ids`` whose record says another entry's row is written (``done``)."""
        held = [e for e in entry_ids if e in self.records]
        if not held:
            return set()
        records = self.redis.mget([self.records[e][0] for e in held])
        return {e for e, r in zip(held, records) if r is not None and text(r).endswith(" done")}

    def queue_ack(self, pipe, entry_id: str, row: ResultRow, keep_final: bool,
                  choices: list[ResultRow] | None = None) -> int | None:
        """Queue on the ack transaction the record's change for a written row (``choices``: every
        choice's row of a request with n > 1 choices, ``row`` the first); returns the position of
        the waiter list's read in ``pipe`` (None when this worker holds no record for it).

        A computed request (every choice ``stop`` or ``length``) becomes ``done``, its final row (or
        rows) kept when its copy had a reply stream; copies waiting for it are taken in the same
        transaction, so that a copy claimed after it finds the record ``done`` (and the stored row)
        instead. A request that ended otherwise (an error, cancelled, expired) may be sent again and
        is then computed again.
        """
        held = self.records.get(entry_id)
        if held is None:
            return None
        record, digest = held
        rows = choices or [row]
        if all(r.finish_reason in ("stop", "length") for r in rows):
            ttl = max(1, math.ceil(self.ttl_s or 1))
            if keep_final:
                pipe.set(final_row_key(record), _ROW_ENCODER.encode(choices or row), ex=ttl)
            pipe.set(record, f"{split(entry_id)[0]} {digest} done", xx=True, keepttl=True)
        position = len(pipe)
        pipe.get(waiters_key(record))
        pipe.set(waiters_key(record), "", px=1, xx=True)
        return position
