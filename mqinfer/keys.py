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
