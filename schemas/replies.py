"""The reply-stream and cancel protocols between workers and producers.

Reply stream messages (stream entry fields; every message has ``id``, ``type``, ``attempt``,
``worker``, and ``job_id`` when the request has one):

- ``delta``: ``token_ids`` (a JSON list), ``text`` (never a partial character) and ``index`` (the
  output position of the first token), one per engine step that produced tokens; with ``n`` > 1
  choices, one per choice and step, with ``choice`` (absent for choice 0).
- ``restart``: the request was redelivered to this worker: drop its partial output.
- ``final``: ``row``, the result row as JSON, equal to the row in the results dataset. It is sent
  once the row is durable, just before the request's stream entry is acked. A request with ``n`` > 1
  choices gets one final, once every choice's row is durable: ``row`` is choice 0's and
  ``choices`` (a JSON list) holds every choice's row in ``index`` order. A request submitted
  again (same ``job_id`` and ``id``; from this or another client) is not computed again: a copy
  with the same content gets the first copy's row (once it is written, if it still runs); a copy
  with different content gets an error row with ``error_code`` ``duplicate_id`` naming the id,
  which is not in the results dataset (that keeps the first copy's row). Content is compared
  without ``reply_to``, ``priority`` and ``deadline``.

Cancelling adds ``[job_id, id]`` to the sorted set ``mqinfer:{S}:cancel`` with the server's time
as score (so a request submitted again later is not cancelled by an old entry); workers check it
for what they read and, every keepalive, for what they run. The set expires a day after the last
cancel.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Union

import msgspec

from mqinfer.schemas import keys
from mqinfer.schemas.rows import ResultRow

REPLY_MAXLEN = 100_000
REPLY_TTL_S = 3600
CANCEL_TTL_S = 24 * 3600


# -- keys and the cancel protocol -------------------------------------------------------------
def new_reply_stream() -> str:
    return f"{keys.REPLY_PREFIX}{uuid.uuid4().hex}"


def cancel_key(stream: str = "requests") -> str:
    """Sorted set of cancelled requests of stream ``S``: same slot as ``mqinfer:{S}``."""
    return f"mqinfer:{{{stream}}}:cancel"


def cancel_member(request_id: str, job_id: str | None) -> bytes:
    return msgspec.json.encode([job_id, request_id])


# KEYS[1] = cancel set, ARGV[1] = member, ARGV[2] = ttl seconds. The score is the server's time,
# comparable with stream entry ids (also server time), so an old cancel cannot hit a later
# request with the same id. Old members are dropped here, not by a sweeper.
CANCEL_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return tostring(now)
"""


# -- reply messages --------------------------------------------------------------------------
class Delta(msgspec.Struct, frozen=True):
    """New tokens of one request: ``token_ids`` start at output position ``index``."""

    id: str
    job_id: str | None
    token_ids: list[int]
    text: str
    index: int
    attempt: int
    worker: str
    type: str = "delta"
    # The choice these tokens belong to (a request with n > 1 choices).
    choice: int = 0


class Restart(msgspec.Struct, frozen=True):
    """The request was redelivered (``attempt``): output received so far is to be discarded."""

    id: str
    job_id: str | None
    attempt: int
    worker: str
    type: str = "restart"


class Final(msgspec.Struct, frozen=True):
    """The request's result row (what the results dataset holds for it): ``row``, and with n > 1
    choices every choice's row in ``choices`` (``row`` is the first of them)."""

    id: str
    job_id: str | None
    attempt: int
    worker: str
    row: ResultRow
    type: str = "final"
    choices: list[ResultRow] = []

    @property
    def rows(self) -> list[ResultRow]:
        """Every choice's row in index order (just ``row`` for a request with one choice)."""
        return list(self.choices) if self.choices else [self.row]


ReplyEvent = Union[Delta, Restart, Final]

_ROW_DECODER = msgspec.json.Decoder(ResultRow)
_ROWS_DECODER = msgspec.json.Decoder(list[ResultRow])
_IDS_DECODER = msgspec.json.Decoder(list[int])
_JSON = msgspec.json.Encoder()


def as_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def parse_reply(fields: Mapping[Any, Any]) -> ReplyEvent:
    """One reply stream message as a typed event; ValueError naming the problem if malformed."""
    f = {as_text(k): v for k, v in fields.items()}
    try:
        kind = as_text(f["type"])
        rid = as_text(f["id"])
        attempt = int(as_text(f.get("attempt", b"1")))
        worker = as_text(f.get("worker", b""))
        job_id = as_text(f["job_id"]) if "job_id" in f else None
        if kind == "delta":
            return Delta(rid, job_id, _IDS_DECODER.decode(f["token_ids"]), as_text(f.get("text", b"")),
                         int(as_text(f["index"])), attempt, worker, choice=int(as_text(f.get("choice", b"0"))))
        if kind == "restart":
            return Restart(rid, job_id, attempt, worker)
        if kind == "final":
            choices = _ROWS_DECODER.decode(f["choices"]) if "choices" in f else []
            return Final(rid, job_id, attempt, worker, _ROW_DECODER.decode(f["row"]), choices=choices)
    except KeyError as exc:
        raise ValueError(f"reply message without field {exc.args[0]!r}") from None
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"malformed reply message: {exc}") from None
    raise ValueError(f"reply message of unknown type {kind!r}")


class ReplyWriter:
    """The worker's side: buffers reply messages and sends them in one pipeline per call of
    :meth:`send` (one round trip per engine step, whatever the number of requests and tokens).

    Each stream is capped at about ``maxlen`` messages (``XADD MAXLEN ~``) and expires
    ``ttl_s`` after its last message. If sending fails the messages stay buffered for the next
    try; past ``max_buffered`` the oldest deltas are dropped (a consumer sees the gap in
    ``index``), never a restart or a final.
    """

    def __init__(self, worker: str, *, maxlen: int = REPLY_MAXLEN, ttl_s: int = REPLY_TTL_S,
                 max_buffered: int = 100_000) -> None:
        if maxlen < 1 or ttl_s < 1 or max_buffered < 1:
            raise ValueError("maxlen, ttl_s and max_buffered must be >= 1")
        self.worker = worker
        self.maxlen = maxlen
        self.ttl_s = ttl_s
        self.max_buffered = max_buffered
        self._buffer: list[tuple[str, dict[str, Any]]] = []
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._buffer)

    def _head(self, kind: str, request_id: str, job_id: str | None, attempt: int) -> dict[str, Any]:
        fields: dict[str, Any] = {"id": request_id, "type": kind, "attempt": attempt, "worker": self.worker}
        if job_id is not None:
            fields["job_id"] = job_id
        return fields

    def restart(self, reply_to: str, request_id: str, job_id: str | None, attempt: int) -> None:
        self._add(reply_to, self._head("restart", request_id, job_id, attempt))

    def delta(self, reply_to: str, request_id: str, job_id: str | None, token_ids: list[int], text: str,
              index: int, attempt: int, choice: int = 0) -> None:
        fields = self._head("delta", request_id, job_id, attempt)
        fields.update(token_ids=_JSON.encode(token_ids), text=text, index=index)
        if choice:
            fields["choice"] = choice
        self._add(reply_to, fields)

    def final(self, reply_to: str, row: Any, choices: list[Any] | None = None) -> None:
        """``row`` is a ResultRow (the one written to the results dataset); ``choices`` every choice's
        row of a request with n > 1 choices (``row`` first)."""
        fields = self._head("final", row.id, row.job_id, row.attempt)
        fields["row"] = _JSON.encode(row)
        if choices and len(choices) > 1:
            fields["choices"] = _JSON.encode(choices)
        self._add(reply_to, fields)

    def _add(self, key: str, fields: dict[str, Any]) -> None:
        buffer = self._buffer
        buffer.append((key, fields))
        if len(buffer) > self.max_buffered:  # only while sending fails: drop the oldest delta
            for i, (_, queued) in enumerate(buffer):
                if queued["type"] == "delta":
                    del buffer[i]
                    self.dropped += 1
                    break

    def send(self, client) -> int:
        """Send everything buffered in one pipeline; returns how many messages went out."""
        if not self._buffer:
            return 0
        pipe = client.pipeline(transaction=False)
        for key, fields in self._buffer:
            pipe.xadd(key, fields, maxlen=self.maxlen, approximate=True)
        for key in dict.fromkeys(key for key, _ in self._buffer):
            pipe.expire(key, self.ttl_s)
        pipe.execute()
        sent = len(self._buffer)
        self._buffer = []
        return sent
