"""What the commands share: configurations from resolved flags, reading and checking an input
file, and submitting requests over the shards. Both ``mqinfer.cli`` and ``mqinfer.run`` use them,
so they live below both."""

from __future__ import annotations

import sys
from pathlib import Path

from mqinfer.config import ENGINE_OPTIONS, STREAM, WORKER_OPTIONS, Option
from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE


def _fields(opts: dict, options: list[Option]) -> dict:
    """Config dataclass fields from resolved flags; a flag missing from ``opts`` keeps the field's default."""
    return {o.field: opts[o.name] for o in options if o.name in opts}


def engine_config(opts: dict):
    from mqinfer.workers.config import EngineConfig

    values = _fields(opts, ENGINE_OPTIONS)
    if "priority_aging_s" in values:
        values["priority_aging_s"] = values["priority_aging_s"] or None  # the flag's 0: strict priority
    return EngineConfig(**values)


def worker_config(opts: dict, *, redis_url: str, out: Path):
    """The worker's configuration from resolved flags; ValueError names a bad flag."""
    from mqinfer.workers.config import WorkerConfig

    values = _fields(opts, [STREAM, *WORKER_OPTIONS])
    if "budgets" in values:
        values["budgets"] = Path(values["budgets"]) if values["budgets"] else None
    return WorkerConfig(redis_url=redis_url, out_dir=out, engine=engine_config(opts), **values)



def read_input(path: str, job_id: str | None):
    """Check every line of INPUT; returns (requests, invalid items, duplicate-id messages).

    A line that repeats an earlier line's id with the same request is a harmless repeat: it is not
    sent, and only a message says so. One that reuses an id for a different request is an invalid
    item (``duplicate_id``, known as ``line:<N>``): its request would otherwise vanish unnoticed."""
    import msgspec

    from mqinfer.schemas import errors
    from mqinfer.schemas.errors import RequestError
    from mqinfer.schemas.files import InputItem, iter_input

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no such input file: {p}")
    requests, invalid, duplicates = [], [], []
    seen: dict[str, tuple[int, bytes]] = {}
    for item in iter_input(p):
        if item.request is None:
            invalid.append(item)
            continue
        req = item.request
        if job_id is not None:
            req = msgspec.structs.replace(req, job_id=job_id)
        key = req.id
        encoded = msgspec.msgpack.encode(req)
        if key in seen:
            first, content = seen[key]
            if content == encoded:
                duplicates.append(f"line {item.line}: id {key!r} repeats line {first} with the same request: "
                                  "not sent again")
            else:
                invalid.append(InputItem(item.line, None, RequestError(
                    errors.DUPLICATE_ID, f"id {key!r} repeats line {first} with a different request: this line "
                    "is not run; ids must be unique within a job - at `$.id`")))
            continue
        seen[key] = (item.line, encoded)
        requests.append(req)
    return requests, invalid, duplicates


def submit_sharded(opts: dict, redis_url: str, requests) -> tuple[int, str]:
    """Requests spread over --shards streams (and/or a Redis Cluster); (count, where)."""
    from mqinfer.client import Client

    client = Client(redis_url, stream=opts["stream"], shards=opts["shards"], cluster=opts["redis_cluster"],
                    fmt=opts.get("format", "msgpack"), route=opts.get("route", "prefix"),
                    lanes=opts["lanes"], max_lanes=opts["max_lanes"],
                    prefix_cache_scope=opts.get("prefix_cache_scope", DEFAULT_PREFIX_CACHE_SCOPE))
    try:
        sent = len(client.submit_many(requests, reply=False))
    finally:
        client.close(delete_reply_stream=False)
    keys_ = client.stream_keys
    if client.router.by_prefix and sent:
        print(routing_summary(client.router), file=sys.stderr)
    return sent, keys_[0] if len(keys_) == 1 else f"{len(keys_)} shards {keys_[0]}..{keys_[-1]}"


def routing_summary(router) -> str:
    """One line on how prefix routing spread the work: each shard's share, and the spill-over."""
    total = sum(router.load) or 1
    shares = " ".join(f"{100.0 * x / total:.0f}%" for x in router.load)
    return (f"routing by prefix: work per shard {shares}; {router.spilled} of {router.routed} requests "
            f"({100.0 * router.spilled / max(1, router.routed):.1f}%) spilled over from their prefix's shard")
