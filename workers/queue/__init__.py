"""The worker's queue side: the worker process and everything it does with the streams.

Reading (``ingest``: room, lanes' fair share, dead workers' entries, ``consumer_group``,
``reconnect``), holding (``ownership``, ``idempotency``, ``last_try``, ``entries``), admitting
(``throttle`` and ``buckets`` for tenants' rate limits, ``jobs`` and ``job_caps`` for bulk jobs),
finishing (``finishing``, ``sink``, ``acks``, ``replies``) and billing (``billing``, ``costs``,
``uptime``, ``busy``, ``slo``, ``kv_prefixes``). ``worker.py`` is the loop that calls them and
drives the engine (``mqinfer.workers.engine``); nothing in the engine imports from here.
"""
