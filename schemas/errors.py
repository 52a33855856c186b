"""Stable error codes for rejected or failed requests, and the exception that carries them.

The codes end up in the ``error_code`` column of result rows and in dead-letter entries, so they
are part of the public contract: add new ones, never rename or reuse one.
"""

from __future__ import annotations

INVALID_JSON = "invalid_json"
INVALID_REQUEST = "invalid_request"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VERSION = "unsupported_version"
PROMPT_TOO_LONG = "prompt_too_long"
MODEL_MISMATCH = "model_mismatch"
INVALID_TOKEN_ID = "invalid_token_id"
MAX_DELIVERIES_EXCEEDED = "max_deliveries_exceeded"
KV_CACHE_TOO_SMALL = "kv_cache_too_small"
INTERNAL_ERROR = "internal_error"
LOST = "lost"
DUPLICATE_ID = "duplicate_id"
BUDGET_EXCEEDED = "budget_exceeded"
# Waited on its tenant's rate limit (--tenant-limits) until its deadline passed.
RATE_LIMITED = "rate_limited"
# A response_format whose schema or grammar the worker cannot compile, or one too large; also a
# grammar that fails while the output is generated (a parser resource limit).
INVALID_RESPONSE_FORMAT = "invalid_response_format"

ALL_CODES = frozenset(
    {
        INVALID_JSON,
        INVALID_REQUEST,
        UNSUPPORTED_PARAMETER,
        UNSUPPORTED_VERSION,
        PROMPT_TOO_LONG,
        MODEL_MISMATCH,
        INVALID_TOKEN_ID,
        MAX_DELIVERIES_EXCEEDED,
        KV_CACHE_TOO_SMALL,
        INTERNAL_ERROR,
        LOST,
        DUPLICATE_ID,
        BUDGET_EXCEEDED,
        RATE_LIMITED,
        INVALID_RESPONSE_FORMAT,
    }
)


class RequestError(Exception):
    """A request was rejected or failed: a stable ``code``, a human ``message`` naming the field.

    ``request_id`` is the request's ``id`` when one could be recovered from the input, else None
    (the caller then decides: ``line:<N>`` in files, the dead-letter stream for stream entries).
    """

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(code, message, request_id)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"RequestError(code={self.code!r}, message={self.message!r}, request_id={self.request_id!r})"

    def with_request_id(self, request_id: str | None) -> RequestError:
        """A copy carrying ``request_id`` (used when the id is recovered one layer up)."""
        return RequestError(self.code, self.message, request_id)
