"""Uptime records: what a live worker leaves in Redis so that its time is billed even if it is killed.

A worker's cost rows add up to its uptime (:mod:`.costs`), but a worker killed outright (SIGKILL,
out of memory, a lost machine) takes its buffered rows with it, and with them the device time its
running requests had used. So each worker keeps a small hash,
:func:`~mqinfer.schemas.keys.worker_uptime`, from the moment its engine is ready:

* ``started_at``: where its timeline (its ``startup`` row) begins; ``model``; ``price`` (USD per
  device-hour); ``share``: the share of a priced device it bills (:mod:`.costs`);
* ``beat``: its last sign of life, written with each keepalive turn (at most a second apart);
* ``billed_s``: the device seconds of the cost rows it wrote. It is raised *before* a flush writes
  them (and put back if the write fails), so a kill during the write can only make the dead
  worker's rows plus its ``lost`` row add up to less than its uptime, never more;
* ``closed``: it stopped cleanly, every second written.

A worker that finds another one dead (its consumer idle in the group, and its beat older than
``--claim-idle-ms``, the test that lets its entries be taken over, and than ``MIN_DEAD_AFTER_S``)
bills what is missing,
``(beat - started_at) * share - billed_s - lost_s`` (``lost_s``: lost time billed for it before), as
a ``lost`` cost row under the dead worker's name, its model, price and share, finished at its last
beat. (A record without ``share``, left by a worker that predates it, counts one device.)
The claim is one script on the hash, so of two claimers only one bills. The claimer marks the
claim done once the row is durable; a claimer that dies first leaves a claim that another one takes
over after ``--claim-idle-ms`` and writes the *same* row (every column comes from the hash), which
compaction removes as an identical copy if the first one was written after all.

A worker that was only stalled (a step longer than ``--claim-idle-ms``) and finds itself billed as
lost when it beats again gives those seconds back from its next ``idle`` rows: once it has idled as
long, its rows plus the ``lost`` row add up to its uptime again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from mqinfer.schemas import keys
from mqinfer.schemas.rows import CostRow
from mqinfer.workers.queue.costs import lost_row
from mqinfer.workers.queue.entries import text

log = logging.getLogger("mqinfer.worker")

# A record outlives its worker's last beat by a week.
RECORD_TTL_S = 7 * 24 * 3600
# A live worker beats about every second even while it waits for entries (its reads block at most
# a second), so a worker is taken for dead after no less than this without a beat, whatever a short
# --claim-idle-ms says.
MIN_DEAD_AFTER_S = 3.0

# KEYS: record. ARGV: now, billed_s ('' = unchanged), started_at, model, price, ttl, closed ('1' or ''),
# fresh ('1': the first beat of a worker, which starts the record over: a worker restarted under the
# same consumer name settles its previous life's record first), share.
# Writes the beat (and the fields a record needs, so that one lost with a server restart is whole
# again); returns the lost seconds another worker billed for this one since the last beat ('0' if none).
_BEAT = """
if ARGV[8] == '1' then
  redis.call('HDEL', KEYS[1], 'billed_s', 'lost_s', 'closed', 'claim', 'claim_at', 'claim_upto', 'claim_s',
             'claim_done', 'claim_seen')
end
local credit = '0'
local upto = redis.call('HGET', KEYS[1], 'claim_upto')
if upto and redis.call('HGET', KEYS[1], 'claim_seen') ~= upto then
  redis.call('HSET', KEYS[1], 'claim_seen', upto)
  credit = redis.call('HGET', KEYS[1], 'claim_s') or '0'
end
redis.call('HSET', KEYS[1], 'beat', ARGV[1], 'started_at', ARGV[3], 'model', ARGV[4], 'price', ARGV[5],
           'share', ARGV[9])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'billed_s', ARGV[2]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'closed', ARGV[7]) end
redis.call('EXPIRE', KEYS[1], ARGV[6])
return credit
"""

# KEYS: record. ARGV: claimer, now, dead_after_s, lease_s.
# Returns {last beat, lost seconds, model, price, share} (as stored, so every claimer builds the same row)
# when the caller is to bill the record's lost time now; nil when there is nothing to bill: no
# record, stopped cleanly, alive, billed already, or being billed by another claimer.
_CLAIM = """
local started = redis.call('HGET', KEYS[1], 'started_at')
if not started or redis.call('HGET', KEYS[1], 'closed') == '1' then return nil end
local now = tonumber(ARGV[2])
local beat_text = redis.call('HGET', KEYS[1], 'beat') or started
local beat = tonumber(beat_text)
local upto = redis.call('HGET', KEYS[1], 'claim_upto')
if upto then
  if redis.call('HGET', KEYS[1], 'claim_done') ~= '1' then
    if now - tonumber(redis.call('HGET', KEYS[1], 'claim_at')) < tonumber(ARGV[4]) then return nil end
    redis.call('HSET', KEYS[1], 'claim', ARGV[1], 'claim_at', ARGV[2])
    return {upto, redis.call('HGET', KEYS[1], 'claim_s'), redis.call('HGET', KEYS[1], 'model') or '',
            redis.call('HGET', KEYS[1], 'price') or '0', redis.call('HGET', KEYS[1], 'share') or '1'}
  end
  if beat <= tonumber(upto) then return nil end
end
if now - beat < tonumber(ARGV[3]) then return nil end
local before = tonumber(redis.call('HGET', KEYS[1], 'lost_s') or '0')
local share = tonumber(redis.call('HGET', KEYS[1], 'share') or '1')
local lost = (beat - tonumber(started)) * share - tonumber(redis.call('HGET', KEYS[1], 'billed_s') or '0') - before
if lost < 0 then lost = 0 end
local lost_text = string.format('%.6f', lost)
redis.call('HSET', KEYS[1], 'claim', ARGV[1], 'claim_at', ARGV[2], 'claim_upto', beat_text, 'claim_s', lost_text,
           'claim_done', '0', 'lost_s', string.format('%.6f', before + tonumber(lost_text)))
return {beat_text, lost_text, redis.call('HGET', KEYS[1], 'model') or '', redis.call('HGET', KEYS[1], 'price') or '0',
        redis.call('HGET', KEYS[1], 'share') or '1'}
"""

# KEYS: record. ARGV: claimer, claim_upto. The claimer's row is durable: the claim is done.
_CONFIRM = """
if redis.call('HGET', KEYS[1], 'claim') == ARGV[1] and redis.call('HGET', KEYS[1], 'claim_upto') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'claim_done', '1')
  return 1
end
return 0
"""


class UptimeRecord:
    """This worker's own record: its beat and the device seconds of the rows it wrote."""

    def __init__(self, redis_client, stream: str, consumer: str, *, started_at: float, model: str,
                 price_per_device_hour: float, device_share: float = 1.0) -> None:
        self.key = keys.worker_uptime(stream, consumer)
        self.started_at = started_at
        self.model = model
        self.price = price_per_device_hour
        # Its uptime times this is what its rows add up to (workers/queue/costs.py).
        self.device_share = device_share
        # Device seconds of this worker's cost rows that are durable.
        self.billed_s = 0.0
        # Lost seconds another worker billed for this one while it was stalled, not yet taken
        # off its idle rows.
        self.credit_s = 0.0
        self._beat = redis_client.register_script(_BEAT)

    def beat(self, now: float, *, billed_s: float | None = None, closed: bool = False, fresh: bool = False) -> None:
        credit = float(text(self._beat(keys=[self.key], args=[
            repr(now), "" if billed_s is None else repr(billed_s), repr(self.started_at), self.model,
            repr(self.price), RECORD_TTL_S, "1" if closed else "", "1" if fresh else "", repr(self.device_share)])))
        if credit > 0:
            log.warning("this worker was taken for dead (no beat for --claim-idle-ms) and %.3fs of its time "
                        "were billed as lost by another worker: its next idle rows give them back", credit)
            self.credit_s += credit

    def before_write(self, now: float, pending_s: float) -> None:
        """Rows of ``pending_s`` device seconds are about to be written."""
        self.beat(now, billed_s=self.billed_s + pending_s)

    def written(self, pending_s: float) -> None:
        self.billed_s += pending_s

    def close(self, now: float) -> None:
        """Stopped cleanly with every row written: nothing to bill as lost."""
        self.beat(now, billed_s=self.billed_s, closed=True)

    def idle_to_bill(self, idle_s: float) -> float:
        """Idle seconds to write, less what another worker already billed as lost for this one."""
        taken = min(idle_s, self.credit_s)
        self.credit_s -= taken
        return idle_s - taken


class LostTime:
    """Finds dead workers of the stream and bills the time they used and never wrote, once."""

    def __init__(self, redis_client, stream: str, group: str, consumer: str, *, claim_idle_ms: int,
                 skip: Callable[[str], bool] = lambda name: False) -> None:
        """``skip(name)``: consumers that are never workers (the hand-back consumer)."""
        self.redis = redis_client
        self.stream = stream
        self.stream_key = keys.request_stream(stream)
        self.group = group
        self.consumer = consumer
        self.dead_after_s = max(claim_idle_ms / 1000.0, MIN_DEAD_AFTER_S)
        self.skip = skip
        # (record key, claim_upto) of lost rows buffered here and not yet durable.
        self.unconfirmed: list[tuple[str, str]] = []

    def previous_life(self, now: float) -> list[CostRow]:
        """The ``lost`` row of an earlier worker of this consumer name (a restart with a fixed
        ``--consumer``) that was killed: it is this worker's to bill, before its record starts over."""
        return self.claim([self.consumer], now, dead_after_s=0.0)

    def scan(self, now: float) -> list[CostRow]:
        """The ``lost`` rows of the group's dead workers that this worker is to write now."""
        try:
            consumers = self.redis.xinfo_consumers(self.stream_key, self.group)
        except redis.exceptions.ResponseError:  # no stream or group yet
            return []
        names = [text(c["name"]) for c in consumers
                 if int(c.get("idle") or 0) >= self.dead_after_s * 1000 and text(c["name"]) != self.consumer
                 and not self.skip(text(c["name"]))]
        return self.claim(names, now)

    def claim(self, names: list[str], now: float, *, dead_after_s: float | None = None) -> list[CostRow]:
        """Bill the workers ``names`` whose records show them dead (no beat for ``dead_after_s``,
        default ``--claim-idle-ms``) and not yet billed."""
        if not names:
            return []
        dead_after_s = self.dead_after_s if dead_after_s is None else dead_after_s
        # One EVAL per record, not a pipeline: a cluster client pipelines no scripts, and a script
        # in a plain pipeline would need SCRIPT EXISTS (not in the worker ACL). Dead workers are few.
        record_keys = [keys.worker_uptime(self.stream, name) for name in names]
        found_all = [self.redis.eval(_CLAIM, 1, key, self.consumer, repr(now), dead_after_s, self.dead_after_s)
                     for key in record_keys]
        rows, nothing_missing = [], []
        for name, key, found in zip(names, record_keys, found_all):
            if not found:
                continue
            upto, lost, model, price, share = (text(v) for v in found)
            device_s, price_per_hour = float(lost), float(price)
            if device_s <= 0:
                nothing_missing.append((key, upto))  # no row to write: done at once
                continue
            self.unconfirmed.append((key, upto))
            log.warning("worker %s is dead (last beat %.3f): billing %.3fs it used and never wrote as lost",
                        name, float(upto), device_s)
            rows.append(lost_row(name, model, price_per_hour, device_s, float(upto), device_share=float(share)))
        if nothing_missing:
            self._confirm_claims(nothing_missing)
        return rows

    def confirm(self) -> None:
        """The lost rows buffered so far are durable: their claims are done."""
        if self.unconfirmed:
            self._confirm_claims(self.unconfirmed)
            self.unconfirmed = []

    def _confirm_claims(self, claims: list[tuple[str, str]]) -> None:
        for key, upto in claims:
            self.redis.eval(_CONFIRM, 1, key, self.consumer, upto)


__all__ = ["MIN_DEAD_AFTER_S", "RECORD_TTL_S", "LostTime", "UptimeRecord"]
