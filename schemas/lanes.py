"""Lanes: one request stream per tenant (and/or per bulk job), so that no backlog blocks the others.

Producers put a request into the lane of its ``tenant`` (``--lanes tenant``, the default), of its
``job_id`` (``job``), of both (``tenant,job``), or into the plain stream ``mqinfer:{S}``
(``none``). A request of the default tenant (``tenant``), without a job (``job``), or both
(``tenant,job``) also goes to the plain stream, which is the lane every worker always reads: so a
single-tenant deployment, and any producer that writes the plain stream itself, work as before.

A lane of stream ``S`` is the stream ``S:lane:<name>``; all its keys (``mqinfer:{S:lane:<name>}``,
its in-flight hash and idempotency records) share that hash tag, so one lane and its consumer
group live in one Redis Cluster slot and a worker's ack of a lane's entries stays one
transaction. The name is a readable slug of the tenant or job, cut short, plus a hash of the
whole value: no tenant name can spell a key outside the scheme, and two names never share a
lane by accident.

The registry ``mqinfer:{S}:lanes`` (a sorted set: lane name -> when a producer last used it)
lists the live lanes; workers read it again whenever its version counter
``mqinfer:{S}:lanes:version`` moves. It is bounded: a producer registers a lane with one script
that counts the registry, and past ``max_lanes - shared`` dedicated lanes a new tenant (or job)
hashes onto one of ``shared`` lanes (``shared-<i>``), so the registry never holds more than
``max_lanes``. A new lane also gets a notice entry (field ``lane``) on the plain stream, which
wakes a worker blocked reading (and so does a lane's first request after ``WAKE_AFTER_S`` unused);
workers drop notices without a row.
"""

from __future__ import annotations

import hashlib
import re
import time
import zlib

from mqinfer.schemas import keys

LANE_MODES = ("tenant", "job", "tenant,job", "none")
DEFAULT_LANES = "tenant"
DEFAULT_MAX_LANES = 64
# Where a lane's stream name starts after its base stream's name.
LANE_INFIX = ":lane:"
# The field of a notice entry on the plain stream (a new lane was registered).
NOTICE_FIELD = "lane"
# The default tenant's requests (with --lanes tenant) stay on the plain stream.
DEFAULT_TENANT = "default"
# The readable part of a lane name, at most this many characters of each value.
_SLUG_CHARS = 24
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_VALID_LANE = re.compile(r"[A-Za-z0-9_.-]{1,128}")

# A lane no producer used for this long gets a notice again with its next request: it wakes a
# worker blocked reading and, where workers scale to zero on the plain stream's lag (KEDA,
# ops/deploy/keda.yaml), starts one.
WAKE_AFTER_S = 30
# Registers a lane, bounded. KEYS: registry, version counter. ARGV: lane, now, max lanes, shared
# lane (the one this value hashes onto when the registry is full), shared lanes reserved, seconds
# unused after which a known lane is woken again. Returns {lane used, 1 when a notice is due: the
# lane is new, or was unused that long}.
REGISTER_SCRIPT = """
local lane = ARGV[1]
local last = redis.call('ZSCORE', KEYS[1], lane)
if last then
  redis.call('ZADD', KEYS[1], ARGV[2], lane)
  if tonumber(last) < tonumber(ARGV[2]) - tonumber(ARGV[6]) then return {lane, 1} end
  return {lane, 0}
end
local limit = tonumber(ARGV[3])
if redis.call('ZCARD', KEYS[1]) < limit - tonumber(ARGV[5]) then
  redis.call('ZADD', KEYS[1], ARGV[2], lane)
  redis.call('INCR', KEYS[2])
  return {lane, 1}
end
lane = ARGV[4]
local fresh = 0
last = redis.call('ZSCORE', KEYS[1], lane)
if not last then
  fresh = 1
  redis.call('INCR', KEYS[2])
elseif tonumber(last) < tonumber(ARGV[2]) - tonumber(ARGV[6]) then
  fresh = 1
end
redis.call('ZADD', KEYS[1], ARGV[2], lane)
return {lane, fresh}
"""

# Removes a lane whose stream is empty, with nothing pending, atomically in the lane's slot.
# KEYS: the lane's stream. ARGV: the group. Returns 1 when the stream was deleted.
DROP_EMPTY_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 1 end
if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if ok then
  for _, g in ipairs(groups) do
    for i = 1, #g, 2 do
      if g[i] == 'pending' and tonumber(g[i + 1]) > 0 then return 0 end
    end
  end
end
redis.call('DEL', KEYS[1])
return 1
"""

# Removes a lane from the registry unless a producer used it since ``cutoff``. KEYS: registry,
# version. ARGV: lane, cutoff. Returns 1 when removed.
UNREGISTER_SCRIPT = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
if tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('INCR', KEYS[2])
return 1
"""


def parse_lanes(value: str) -> str:
    """A ``--lanes`` value, normalised (``job,tenant`` is ``tenant,job``); ValueError names the choices."""
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    norm = ",".join(sorted(set(parts), key=("tenant", "job", "none").index)) if all(
        p in ("tenant", "job", "none") for p in parts) else None
    if norm not in LANE_MODES:
        raise ValueError(f"--lanes must be one of {', '.join(LANE_MODES)}; got {value!r}")
    return norm


def check_max_lanes(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 100_000:
        raise ValueError(f"--max-lanes must be an integer from 1 to 100000; got {value!r}")
    return value


def shared_count(max_lanes: int) -> int:
    """Lanes kept for tenants (or jobs) past the limit: an eighth of ``max_lanes``, at least one."""
    return max(1, max_lanes // 8)


def _slug(value: str) -> str:
    return _SLUG_UNSAFE.sub("_", value)[:_SLUG_CHARS] or "_"


def _digest(*values: str) -> str:
    return hashlib.sha256("\x00".join(values).encode()).hexdigest()[:12]


def lane_name(mode: str, tenant: str, job_id: str | None) -> str | None:
    """The lane a request belongs to by its tenant and job under ``mode``; None for the plain stream."""
    if mode == "none":
        return None
    if mode == "tenant":
        return None if tenant == DEFAULT_TENANT else f"t-{_slug(tenant)}-{_digest('t', tenant)}"
    if mode == "job":
        return None if job_id is None else f"j-{_slug(job_id)}-{_digest('j', job_id)}"
    if tenant == DEFAULT_TENANT and job_id is None:
        return None
    return f"tj-{_slug(tenant)}-{_slug(job_id or '')}-{_digest('tj', tenant, job_id or '')}"


def is_job_lane(lane: str | None) -> bool:
    """Whether ``lane`` holds the requests of one job (modes ``job`` and ``tenant,job``): the
    engine then shares its slots between such lanes as it does between tenants."""
    return lane is not None and lane.startswith(("j-", "tj-"))


def shared_lane(lane: str, max_lanes: int) -> str:
    """The shared lane a lane's requests go to once the registry is full."""
    return f"shared-{zlib.crc32(lane.encode()) % shared_count(max_lanes)}"


def lane_stream(stream: str, lane: str | None) -> str:
    """The stream name of ``lane`` of ``stream`` (the plain stream for None)."""
    return stream if lane is None else f"{stream}{LANE_INFIX}{lane}"


def lane_of_stream(stream: str, name: str) -> str | None:
    """The lane of a stream name of ``stream``'s (None for the plain stream itself)."""
    if name == stream:
        return None
    prefix = stream + LANE_INFIX
    if not name.startswith(prefix):
        raise ValueError(f"{name!r} is not a lane of stream {stream!r}")
    return name[len(prefix):]


def registry_key(stream: str) -> str:
    """Sorted set of the live lanes of stream ``S`` (lane name -> when a producer last used it)."""
    return f"mqinfer:{{{stream}}}:lanes"


def registry_version_key(stream: str) -> str:
    """Counter moved whenever a lane joins or leaves the registry: workers re-read it then."""
    return f"mqinfer:{{{stream}}}:lanes:version"


def lane_stream_keys(stream: str, lanes) -> list[str]:
    """The stream keys of the plain stream and the given lanes."""
    return [keys.request_stream(stream)] + [keys.request_stream(lane_stream(stream, lane)) for lane in lanes]


def valid_lane(lane: str) -> bool:
    """A registry member that this scheme could have made (anything else is ignored by readers)."""
    return _VALID_LANE.fullmatch(lane) is not None


def registered(redis_client, stream: str) -> list[str]:
    """The lanes of ``stream`` in its registry (members this scheme could not have made are left out)."""
    names = [m.decode() if isinstance(m, bytes) else str(m)
             for m in redis_client.zrange(registry_key(stream), 0, -1)]
    return [n for n in names if valid_lane(n)]


def stream_keys(redis_client, stream: str) -> list[str]:
    """The stream keys of the plain stream and of every registered lane of ``stream``."""
    return lane_stream_keys(stream, registered(redis_client, stream))


def remove_lane(redis_client, stream: str, lane: str, group: str = keys.GROUP, *, cutoff: float | None = None,
                unregister=None, drop_empty=None) -> bool:
    """Remove a lane whose stream is empty with nothing pending: its stream, then its registry
    entry (unless a producer used it after ``cutoff``; None: whenever it was used). False when the
    lane still holds entries. A producer that adds to it afterwards registers it again."""
    drop_empty = drop_empty or redis_client.register_script(DROP_EMPTY_SCRIPT)
    unregister = unregister or redis_client.register_script(UNREGISTER_SCRIPT)
    if not valid_lane(lane):
        return False
    if not int(drop_empty(keys=[keys.request_stream(lane_stream(stream, lane))], args=[group])):
        return False
    unregister(keys=[registry_key(stream), registry_version_key(stream)],
               args=[lane, 1e18 if cutoff is None else cutoff])
    return True


def register_lane(redis_client, stream: str, lane: str, max_lanes: int, *, script=None) -> str:
    """Register ``lane`` of ``stream`` for a producer that talks to Redis directly (redis-py):
    bounded by ``max_lanes`` (past it, the shared lane it hashes onto), with the workers' group at
    the lane's start, and a notice on the plain stream when the lane is new or was unused for
    ``WAKE_AFTER_S``. Returns the lane used. ``script``: ``REGISTER_SCRIPT`` already registered
    with the client (else it is registered here)."""
    import redis

    script = script or redis_client.register_script(REGISTER_SCRIPT)
    used, fresh = script(
        keys=[registry_key(stream), registry_version_key(stream)],
        args=[lane, time.time(), max_lanes, shared_lane(lane, max_lanes), shared_count(max_lanes), WAKE_AFTER_S])
    used = used.decode() if isinstance(used, bytes) else str(used)
    try:
        redis_client.xgroup_create(keys.request_stream(lane_stream(stream, used)), keys.GROUP, id="0", mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    if int(fresh):
        redis_client.xadd(keys.request_stream(stream), {NOTICE_FIELD: used})
    return used

