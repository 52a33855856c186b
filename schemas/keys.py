"""Redis key names of the public contract.

The braces are Redis Cluster hash tags: a request stream and its dead letters share a slot; a
job's keys share its job id's slot, a tenant's rate-limit bucket its tenant's.
"""

from __future__ import annotations

import hashlib
import zlib

GROUP = "workers"
REPLY_PREFIX = "mqinfer:reply:"
SCHEMA_VERSION = "1"


def request_stream(stream: str = "requests") -> str:
    return f"mqinfer:{{{stream}}}"


def dead_letter_stream(stream: str = "requests") -> str:
    return f"mqinfer:{{{stream}}}:dead"


def job_key(job_id: str) -> str:
    """Hash of a bulk job registered with `mqinfer jobs submit` (status, counts, settings)."""
    return f"mqinfer:job:{{{job_id}}}"


def job_cost(job_id: str) -> str:
    """Hash of a job's cost cap: ``max_cost_usd`` (``--max-cost-usd`` of `mqinfer run` or `mqinfer
    jobs submit`) and ``spent_usd`` (raised by workers by each request's cost as they ack it)."""
    return f"mqinfer:job:{{{job_id}}}:cost"


def job_results_stream(job_id: str) -> str:
    """Final result rows of a registered bulk job's requests, written by workers as they ack."""
    return f"mqinfer:job:{{{job_id}}}:results"


def job_done_set(stream: str, job_id: str) -> str:
    """Ids of a job's requests that have a durable row (`mqinfer run` counts these for progress)."""
    return f"mqinfer:{{{stream}}}:done:{job_id}"


def generated_tokens(stream: str) -> str:
    """Hash of job_id -> output tokens generated so far by the workers of stream ``S`` (rows
    written or not), which `mqinfer run` shows as progress while its first requests still run."""
    return f"mqinfer:{{{stream}}}:generated"


def idempotency_key(stream: str, job_id: str | None, request_id: str) -> str:
    """A request's idempotency record: the first stream entry that carried it, its content hash and
    whether its row is written. The name hashes (job_id, id), so no id can spell another's key."""
    digest = hashlib.sha256(f"{job_id or ''}\x00{request_id}".encode()).hexdigest()[:40]
    return f"mqinfer:{{{stream}}}:idem:{digest}"


def inflight_hash(stream: str) -> str:
    """Hash of entry id -> [job_id, id, tenant, request_type] for entries read and not yet acked, so
    that a request whose entry is trimmed from the stream while pending can still end with a row."""
    return f"mqinfer:{{{stream}}}:inflight"


def ran_alone(stream: str, entry_id: str) -> str:
    """Set (to the worker's consumer name, for a day) when an entry's last try starts running alone
    in a worker: if that worker dies, the entry is the one that killed it."""
    return f"mqinfer:{{{stream}}}:alone:{entry_id}"


def worker_uptime(stream: str, consumer: str) -> str:
    """Hash of one worker of stream ``S``: when its timeline began, its last heartbeat, the device
    seconds of the cost rows it has written, its model and price, and the claim of whoever bills the
    time it used and never wrote (the ``lost`` cost row) once it is found dead."""
    return f"mqinfer:{{{stream}}}:uptime:{consumer}"


def gap_marker(stream: str, last_delivered_id: str) -> str:
    """Taken (SET NX) by the one worker that reports entries trimmed before delivery after this id."""
    return f"mqinfer:{{{stream}}}:gap:{last_delivered_id}"


def kv_tier_prefixes(stream: str) -> str:
    """Sorted set of the prompt prefixes (8-byte digests of their route keys, scored by the unix time
    last seen) whose KV blocks the tiers of the workers reading ``stream`` hold: prefix routing
    prefers the shard whose workers hold a prefix."""
    return f"mqinfer:{{{stream}}}:kv-prefixes"


def rate_limit_bucket(tenant: str) -> str:
    """Hash of a tenant's rate-limit buckets (tokens and requests left, when last refilled), shared
    by every worker of the server whatever its stream, so that a tenant's limit holds across all
    of them. Hash-tagged by tenant: each tenant's bucket is one key in one slot."""
    return f"mqinfer:ratelimit:{{{tenant}}}"


def shard_streams(stream: str, shards: int) -> list[str]:
    """The stream names of ``stream`` split into ``shards`` (one shard keeps the plain name)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be a positive integer, got {shards!r}")
    if shards == 1:
        return [stream]
    return [f"{stream}-{i}" for i in range(shards)]


def shard_index(request_id: str, job_id: str | None, shards: int) -> int:
    """The shard a request lives on: a stable hash of (job_id, id), the request's identity."""
    if shards == 1:
        return 0
    key = f"{job_id or ''}\x1f{request_id}".encode()
    return zlib.crc32(key) % shards
