"""What a worker tells those who watch its requests, and when.

Reply streams (the protocol is :mod:`mqinfer.schemas.replies`): a ``restart`` when a request is
delivered again, a ``delta`` per engine step that produced tokens, and the ``final`` row only once
that row is durable (sent just before the entry's ack). A copy of a request answered without
computing it gets its final message at once (the first copy's stored row, or a ``duplicate_id``
error row), or, while the first copy still runs, when that copy's row is written.

Progress: the output tokens generated per job go to the hash ``mqinfer:{S}:generated`` (job id ->
tokens), which `mqinfer run` shows while its first requests still run. The counts ride in the
pipeline that carries the reply messages; without messages to send, they go on their own at most
every ``interval_s``.
"""

from __future__ import annotations

import logging

import redis

from mqinfer.schemas import keys
from mqinfer.schemas.replies import ReplyWriter
from mqinfer.schemas.request import Request
from mqinfer.schemas.rows import ResultRow
from mqinfer.workers.queue.entries import InFlight

log = logging.getLogger("mqinfer.worker")

# Counts of generated tokens are sent at least this often while tokens are generated.
PROGRESS_INTERVAL_S = 0.5
# The generated-tokens hash outlives its last update by a week.
PROGRESS_TTL_S = 7 * 24 * 3600


class GeneratedTokens:
    """Output tokens generated per job id since the counts were last sent."""

    def __init__(self, stream: str, *, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.key = keys.generated_tokens(stream)
        self.interval_s = interval_s
        self._counts: dict[str, int] = {}
        self._sent_at = float("-inf")
        # Whether counts were sent once (so the Redis user may write the hash), and still are.
        self.checked = False
        self.enabled = True

    def __bool__(self) -> bool:
        return bool(self._counts)

    def add(self, job_id: str, tokens: int) -> None:
        if self.enabled:
            self._counts[job_id] = self._counts.get(job_id, 0) + tokens

    def due(self, now: float) -> bool:
        return bool(self._counts) and now - self._sent_at >= self.interval_s

    def queue(self, pipe) -> None:
        """One increment per job on ``pipe``, and the hash's expiry. HINCRBYFLOAT, which the
        worker's ACL grants for budgets, adds integers exactly and stores them without a point."""
        for job_id, tokens in self._counts.items():
            pipe.hincrbyfloat(self.key, job_id, tokens)
        pipe.expire(self.key, PROGRESS_TTL_S)

    def sent(self, now: float) -> None:
        self._counts.clear()
        self._sent_at = now

    def send_alone(self, client, now: float) -> None:
        """Send the counts in a pipeline of their own; when the Redis user may not write the hash
        (an ACL without HINCRBYFLOAT), stop counting and say so once."""
        pipe = client.pipeline(transaction=False)
        self.queue(pipe)
        try:
            pipe.execute()
        except redis.exceptions.NoPermissionError as exc:
            self.checked, self.enabled = True, False
            self._counts.clear()
            log.warning("progress counts are off: this Redis user may not write %s (%s); grant HINCRBYFLOAT "
                        "on it", self.key, exc)
            return
        self.checked = True
        self.sent(now)


class _OnePipeline:
    """Hands ``ReplyWriter.send`` (which asks its client for one pipeline) a pipeline that already
    holds the progress counts, so that both travel in one round trip."""

    def __init__(self, pipe) -> None:
        self._pipe = pipe

    def pipeline(self, transaction: bool = False):
        return self._pipe


class Replies:
    def __init__(self, worker: str, stream: str, *, maxlen: int, ttl_s: int) -> None:
        self.writer = ReplyWriter(worker, maxlen=maxlen, ttl_s=ttl_s)
        self.generated = GeneratedTokens(stream)
        # Final messages whose rows are not durable yet: (reply stream, row, every choice's row or None).
        self._finals: list[tuple[str, ResultRow, list[ResultRow] | None]] = []

    def __len__(self) -> int:
        """Messages buffered to send."""
        return len(self.writer)

    def restart(self, request: Request, attempt: int) -> None:
        """The request was delivered again: its consumer drops what an earlier worker sent."""
        if request.reply_to is not None:
            self.writer.restart(request.reply_to, request.id, request.job_id, attempt)

    def step_output(self, item: InFlight, out) -> None:
        """A request's output of one engine step: its new tokens, on its reply stream and in its
        job's count."""
        req = item.request
        if out.new_token_ids and req.job_id is not None:
            self.generated.add(req.job_id, len(out.new_token_ids))
        if req.reply_to is not None and (out.new_token_ids or out.new_text):
            index = len(out.output_token_ids) - len(out.new_token_ids)
            self.writer.delta(req.reply_to, req.id, req.job_id, out.new_token_ids, out.new_text, index,
                              item.attempt, out.index)

    def final_when_durable(self, reply_to: str, row: ResultRow, choices: list[ResultRow] | None = None) -> None:
        """``row``, with ``choices`` (every choice's row) for a request with n > 1 choices."""
        self._finals.append((reply_to, row, choices))

    def rows_durable(self) -> None:
        """The rows buffered so far are durable: their final messages may go."""
        for reply_to, row, choices in self._finals:
            self.writer.final(reply_to, row, choices)
        self._finals.clear()

    def final(self, reply_to: str, row: ResultRow, choices: list[ResultRow] | None = None) -> None:
        """A final message to send now (a row that is durable already, or one never written)."""
        self.writer.final(reply_to, row, choices)

    def due(self, now: float) -> bool:
        """Whether :meth:`send` has anything to send now."""
        return bool(len(self.writer)) or self.generated.due(now)

    def send(self, client, now: float, *, force: bool = False) -> None:
        """Send the buffered messages and, with them or when due (``force``: whatever is counted),
        the generated-token counts: one pipeline."""
        counts = bool(self.generated) and (force or len(self.writer) > 0 or self.generated.due(now))
        if counts and not self.generated.checked:
            # The first counts go alone: a Redis user that may not write the hash turns progress
            # off without failing (and later re-sending) the reply messages beside them.
            self.generated.send_alone(client, now)
            counts = False
        if not counts and not len(self.writer):
            return
        pipe = client.pipeline(transaction=False)
        if counts:
            self.generated.queue(pipe)
        if len(self.writer):
            self.writer.send(_OnePipeline(pipe))
        else:
            pipe.execute()
        if counts:
            self.generated.sent(now)
