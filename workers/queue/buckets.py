"""Token buckets in Redis: one hash per rate-limited tenant (``keys.rate_limit_bucket``), shared by
every worker, refilled and taken from by one Lua script so that takes from any number of workers
never add up to more than the limit.

The script takes several requests of one tenant at once, in their order, and stops at the first
that does not fit (a tenant's requests are admitted first come first served; a large one is not
overtaken by small ones forever). A request fits when the bucket holds its tokens, or is full
(one second of the rate) for a request larger than that: it then takes the whole amount and
leaves the bucket in debt, which the refill pays back before the next one, so that the long-run
rate still holds and no request is too large to ever run. The script answers how many it took
and how long until the next would fit, so that a worker asks again only then.

Time is the Redis server's (``TIME``), one clock for all workers; a worker running on an injected
clock (a test driving the loop) passes its own instead. A bucket not touched for long enough to be
full again expires: a missing key is a full bucket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import redis

from mqinfer.schemas import keys
from mqinfer.workers.tenant_limits import TenantLimit

log = logging.getLogger("mqinfer.worker")

# KEYS[1]: the tenant's bucket hash (fields t: tokens left, r: requests left, ts: last refill).
# ARGV: tokens per second, requests per second (0: no request limit), now in seconds ('' for the
# server's TIME), then the token cost of each request to take, in order.
# Returns {requests taken, microseconds until the next one would fit (0 when all were taken)}.
_TAKE_SCRIPT = """
local rate = tonumber(ARGV[1])
local req_rate = tonumber(ARGV[2])
local now
if ARGV[3] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  now = tonumber(ARGV[3])
end
local cap = rate
local req_cap = math.max(req_rate, 1)
local state = redis.call('HMGET', KEYS[1], 't', 'r', 'ts')
local tokens = tonumber(state[1]) or cap
local reqs = tonumber(state[2]) or req_cap
local last = tonumber(state[3]) or now
if now > last then
  tokens = math.min(cap, tokens + (now - last) * rate)
  if req_rate > 0 then reqs = math.min(req_cap, reqs + (now - last) * req_rate) end
  last = now
end
local taken = 0
local wait = 0
for i = 4, #ARGV do
  local need = math.min(tonumber(ARGV[i]), cap)
  if tokens < need or (req_rate > 0 and reqs < 1) then
    wait = math.max(0, (need - tokens) / rate)
    if req_rate > 0 then wait = math.max(wait, (1 - reqs) / req_rate) end
    break
  end
  tokens = tokens - tonumber(ARGV[i])
  if req_rate > 0 then reqs = reqs - 1 end
  taken = taken + 1
end
redis.call('HSET', KEYS[1], 't', string.format('%.17g', tokens), 'r', string.format('%.17g', reqs),
           'ts', string.format('%.17g', last))
local full_in = (cap - tokens) / rate
if req_rate > 0 then full_in = math.max(full_in, (req_cap - reqs) / req_rate) end
redis.call('PEXPIRE', KEYS[1], math.ceil(full_in * 1000) + 1000)
return {taken, math.ceil(wait * 1000000)}
"""


class RateLimitUnavailable(ValueError):
    """Limits are configured but this Redis user may not run the bucket script."""


class TokenBuckets:
    """The buckets of the tenants in ``limits``; ``clock``: None for the server's time."""

    def __init__(self, redis_client, limits: Mapping[str, TenantLimit], *,
                 clock: Callable[[], float] | None = None) -> None:
        self.redis = redis_client
        self.limits = dict(limits)
        self.clock = clock
        self._take = redis_client.register_script(_TAKE_SCRIPT)

    def take(self, tenant: str, costs: Sequence[int]) -> tuple[int, float]:
        """Take the first requests of ``costs`` (token costs, in order) that fit the tenant's
        buckets: (how many were taken, seconds until the next one would fit; 0 when all were)."""
        limit = self.limits[tenant]
        now = "" if self.clock is None else repr(float(self.clock()))
        taken, wait_us = self._take(keys=[keys.rate_limit_bucket(tenant)],
                                    args=[repr(float(limit.tokens_per_s)), repr(float(limit.requests_per_s or 0)),
                                          now, *(int(c) for c in costs)])
        return int(taken), int(wait_us) / 1e6

    def check(self) -> None:
        """Run the script once for every limited tenant, taking nothing: RateLimitUnavailable
        when this Redis user may not run it (or a command in it), so that a worker refuses to
        start rather than serve without the limits it was given."""
        for tenant in self.limits:
            try:
                self.take(tenant, [])
            except redis.exceptions.ResponseError as exc:
                # EVALSHA itself refused: NOPERM; a command inside the script refused: an error
                # reply that says so ("ACL failure in script: ... no permissions ...").
                if not (isinstance(exc, redis.exceptions.NoPermissionError) or "ACL failure" in str(exc)
                        or "no permissions" in str(exc)):
                    raise
                raise RateLimitUnavailable(
                    f"--tenant-limits cannot be enforced: this Redis user may not run the rate-limit script "
                    f"on {keys.rate_limit_bucket(tenant)} ({exc}); grant EVALSHA, EVAL, SCRIPT LOAD, TIME, HMGET, "
                    "HSET and PEXPIRE on mqinfer:ratelimit:* (see ops/acl/users.acl), or run without "
                    "--tenant-limits") from None


def server_clock_unless(clock: Callable[[], float]) -> Callable[[], float] | None:
    """The buckets' clock for a worker on ``clock``: the server's (None) on real time, else the
    injected one (a test that moves time by hand moves the buckets' refill with it)."""
    return None if clock is time.time else clock
