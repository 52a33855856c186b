"""The inference worker, in two rooms: ``queue/`` (the worker process and the streams: ingest,
ownership, acks, replies, billing) and ``engine/`` (engine, model runner, models and loading, KV
tiers, structured output, proposers). Beside them, what both use: the settings (``config``,
``devices``, ``tenant_limits``) and the garbage collector's set-up for long-lived processes
(``heap``)."""

from mqinfer._checkout import defer_if_bare  # README.md, "Where the code lives"

defer_if_bare(__name__)
