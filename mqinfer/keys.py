"""Redis key names of the public contract.

The braces are Redis Cluster hash tags: a request stream and its dead letters share a slot.
"""

from __future__ import annotations

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


def job_results_stream(job_id: str) -> str:
    """Final result rows of a registered bulk job's requests, written by workers as they ack."""
    return f"mqinfer:job:{{{job_id}}}:results"


def job_done_set(stream: str, job_id: str) -> str:
    """Ids of a job's requests that have a durable row (`mqinfer run` counts these for progress)."""
    return f"mqinfer:{{{stream}}}:done:{job_id}"
