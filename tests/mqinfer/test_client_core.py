"""The client's sans-IO core with no Redis at all: plans are driven by hand, action by action, with
results made up by the test and a clock moved by hand. Reply messages are the ones the worker's
ReplyWriter writes, captured on their way out."""

from __future__ import annotations

import pytest
import redis.exceptions

from mqinfer.client_actions import (
    AddCancel,
    AddEntries,
    CreateGroup,
    DeleteStream,
    EndReadTurn,
    ReadBacklog,
    ReadReplies,
    Sleep,
    TakeReadTurn,
)
from mqinfer.client_core import (
    BackpressureError,
    ClientCore,
    NoReplyStream,
    ResultTimeout,
    backlog_from,
)
from mqinfer.client_replies import ReplyBook
from mqinfer.schemas import keys
from mqinfer.schemas.errors import RequestError
from mqinfer.schemas.replies import Delta, Final, ReplyWriter, Restart, cancel_key, cancel_member
from mqinfer.schemas.rows import ResultRow
from mqinfer.schemas.stream import decode_entry
from tests.helpers import FakeClock


def _row(rid: str, text: str = "hi", job_id: str | None = None, attempt: int = 1) -> ResultRow:
    return ResultRow(job_id=job_id, id=rid, model="tiny", finish_reason="length", prompt_tokens=3,
                     output_tokens=2, output_token_ids=[104, 105], text=text, enqueued_at=1.0,
                     started_at=1.5, first_token_at=1.6, finished_at=2.0, worker="w1", attempt=attempt)


class Wire:
    """Where a ReplyWriter sends (it takes this for its Redis connection): keeps each message as
    XREAD returns it, with ids counting up, so tests hand it to the core as a read's result."""

    def __init__(self) -> None:
        self.seq = 0
        self.pending: list[tuple[str, bytes, dict[bytes, bytes]]] = []

    def pipeline(self, transaction: bool = False) -> "Wire":
        return self

    def xadd(self, key: str, fields: dict, **_: object) -> None:
        self.seq += 1
        as_bytes = {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
        self.pending.append((key, f"{self.seq}-0".encode(), as_bytes))

    def expire(self, key: str, ttl: int) -> None:
        pass

    def execute(self) -> list:
        return []

    def response(self) -> list:
        """Everything sent since the last call, as one XREAD response."""
        by_stream: dict[str, list] = {}
        for key, msg_id, fields in self.pending:
            by_stream.setdefault(key, []).append((msg_id, fields))
        self.pending = []
        return [[key.encode(), messages] for key, messages in by_stream.items()]


def drive(plan, answer, clock: FakeClock | None = None, log: list | None = None):
    """Run a plan to its end. ``answer(action)`` gives each action's result (an exception it returns
    is thrown into the plan); Sleep moves the clock. Every action is appended to ``log``."""
    log = [] if log is None else log
    result, error = None, None
    while True:
        try:
            action = plan.send(result) if error is None else plan.throw(error)
        except StopIteration as done:
            return done.value
        log.append(action)
        if isinstance(action, Sleep) and clock is not None:
            clock.advance(action.seconds)
        result = answer(action)
        error = result if isinstance(result, Exception) else None


def _groups(lag: int | None, pending: int) -> list[dict]:
    return [{"name": b"other", "lag": 99, "pending": 99},
            {"name": keys.GROUP.encode(), "lag": lag, "pending": pending}]


# -- settings and submissions -----------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"backpressure": "drop"}, "backpressure must be 'wait' or 'raise'"),
    ({"max_backlog": 0}, "max_backlog must be >= 1"),
    ({"fmt": "xml"}, "fmt must be"),
    ({"reply_to": "not-a-reply-key"}, "reply_to must start with 'mqinfer:reply:'"),
    ({"shards": 0}, "shards"),
    ({"stream": ""}, "invalid stream name"),
    ({"cancel_ttl_s": 0}, "cancel_ttl_s must be >= 1"),
])
def test_settings_are_checked_when_the_core_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClientCore(**kwargs)


def test_a_submission_is_validated_whole_then_sent_per_shard_in_chunks():
    core = ClientCore(stream="s", shards=3)
    with pytest.raises(RequestError) as info:
        core.prepare([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x", "top_p": 7}], None, True)
    assert "request 'b'" in info.value.message and "top_p" in info.value.message
    with pytest.raises(RequestError, match="request #1: id 'a' appears twice"):
        core.prepare([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], None, True)

    reqs = core.prepare(({"id": f"r{i}", "prompt": "x"} for i in range(12)), "job-1", True)
    actions: list = []
    ids = drive(core.submit(reqs, chunk_size=2), lambda a: None, log=actions)
    assert ids == [f"r{i}" for i in range(12)]
    sent: dict[str, list[str]] = {}
    for action in actions:
        if isinstance(action, CreateGroup):
            assert action.group == keys.GROUP and action.stream_key not in sent  # made before its entries
            sent[action.stream_key] = []
        else:
            assert isinstance(action, AddEntries) and 1 <= len(action.entries) <= 2
            for fields in action.entries:
                req = decode_entry(fields)
                assert (req.job_id, req.reply_to) == ("job-1", core.reply_to)
                assert core.stream_keys[core.shard_of(req.id, "job-1")] == action.stream_key
                sent[action.stream_key].append(req.id)
    assert sorted(rid for rids in sent.values() for rid in rids) == sorted(ids)
    assert len(sent) == 3 and all(rids for rids in sent.values())

    # Groups are made once per stream; reply=False leaves reply_to unset.
    actions = []
    drive(core.submit(core.prepare([{"id": "late", "prompt": "x"}], None, False)), lambda a: None, log=actions)
    (add,) = actions
    assert decode_entry(add.entries[0]).reply_to is None
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        drive(core.submit(reqs, chunk_size=0), lambda a: None)


def test_an_existing_group_is_fine_and_other_errors_stop_the_submission():
    core = ClientCore()
    reqs = core.prepare([{"id": "a", "prompt": "x"}], None, True)
    actions: list = []
    busy = redis.exceptions.ResponseError("BUSYGROUP Consumer Group name already exists")
    drive(core.submit(reqs), lambda a: busy if isinstance(a, CreateGroup) else None, log=actions)
    assert [type(a) for a in actions] == [CreateGroup, AddEntries]

    other = ClientCore()
    actions = []
    denied = redis.exceptions.ResponseError("NOPERM this user has no permissions")
    with pytest.raises(redis.exceptions.ResponseError, match="NOPERM"):
        drive(other.submit(other.prepare([{"id": "a", "prompt": "x"}], None, True)), lambda a: denied, log=actions)
    assert [type(a) for a in actions] == [CreateGroup]


# -- backpressure -------------------------------------------------------------------------------
def test_the_backlog_is_lag_plus_pending_or_the_stream_length():
    assert backlog_from(_groups(lag=4, pending=3), 50) == 7
    assert backlog_from(_groups(lag=None, pending=3), 5) == 5  # no lag after deletions: XLEN
    assert backlog_from([{"name": b"other", "lag": 1, "pending": 1}], 6) == 6  # no workers' group yet
    core = ClientCore(shards=2)
    actions: list = []
    assert drive(core.backlog(1), lambda a: (_groups(2, 1), 3), log=actions) == 3
    assert actions == [ReadBacklog("mqinfer:{requests-1}")]
    no_stream = redis.exceptions.ResponseError("ERR no such key")
    assert drive(core.backlog(0), lambda a: no_stream) == 0
    with pytest.raises(ValueError, match="shard must be in 0..1"):
        drive(core.backlog(2), lambda a: None)


def test_backpressure_raise_sends_nothing_over_the_limit():
    core = ClientCore(max_backlog=3, backpressure="raise", clock=FakeClock())
    actions: list = []
    answers = {ReadBacklog: (_groups(lag=2, pending=1), 3)}
    with pytest.raises(BackpressureError) as info:
        drive(core.submit(core.prepare([{"id": "a", "prompt": "x"}], None, True)),
              lambda a: answers.get(type(a)), log=actions)
    assert (info.value.backlog, info.value.limit, info.value.stream_key) == (3, 3, "mqinfer:{requests}")
    assert str(info.value) == "mqinfer:{requests} has a backlog of 3 requests (limit 3); nothing was sent"
    assert [type(a) for a in actions] == [CreateGroup, ReadBacklog]


def test_backpressure_wait_checks_again_with_growing_steps_and_sends_what_fits():
    clock = FakeClock(0.0)
    core = ClientCore(max_backlog=3, backpressure_timeout_s=10, clock=clock)
    backlogs = iter([3, 3, 4, 1, 3, 0])

    def answer(action):
        return (_groups(lag=next(backlogs), pending=0), 0) if isinstance(action, ReadBacklog) else None

    actions: list = []
    reqs = core.prepare([{"id": f"r{i}", "prompt": "x"} for i in range(5)], None, True)
    assert drive(core.submit(reqs), answer, clock, actions) == [f"r{i}" for i in range(5)]
    steps = [(type(a).__name__, a.seconds if isinstance(a, Sleep) else
              len(a.entries) if isinstance(a, AddEntries) else None) for a in actions[1:]]
    assert steps == [("ReadBacklog", None), ("Sleep", 0.05), ("ReadBacklog", None), ("Sleep", 0.1),
                     ("ReadBacklog", None), ("Sleep", 0.2), ("ReadBacklog", None), ("AddEntries", 2),
                     ("ReadBacklog", None), ("Sleep", 0.05), ("ReadBacklog", None), ("AddEntries", 3)]
    assert clock.now == pytest.approx(0.4)


def test_backpressure_wait_gives_up_at_its_deadline():
    clock = FakeClock(0.0)
    core = ClientCore(max_backlog=2, backpressure_timeout_s=1.0, clock=clock)
    actions: list = []
    full = (_groups(lag=5, pending=0), 5)
    with pytest.raises(BackpressureError, match=r"backlog of 5 requests \(limit 2\) after waiting 1.0s"):
        drive(core.submit(core.prepare([{"id": "a", "prompt": "x"}], None, True)),
              lambda a: full if isinstance(a, ReadBacklog) else None, clock, actions)
    sleeps = [a.seconds for a in actions if isinstance(a, Sleep)]
    assert sleeps[:4] == [0.05, 0.1, 0.2, 0.4] and sleeps[4] == pytest.approx(0.25)  # the last one fits the deadline
    assert clock.now == pytest.approx(1.0)
    assert not any(isinstance(a, AddEntries) for a in actions)


# -- reply events -------------------------------------------------------------------------------
def test_restarts_drop_stale_attempts_and_other_workers_deltas():
    book = ReplyBook()
    key = (None, "r")
    assert book.add(Delta("r", None, [1], "a", 0, 1, "old"))
    assert book.add(Restart("r", None, 2, "new"))
    assert not book.add(Delta("r", None, [2], "b", 1, 1, "old"))  # the old attempt, not noticed yet
    assert not book.add(Delta("r", None, [9], "z", 0, 2, "old"))  # right attempt, wrong worker
    assert book.add(Delta("r", None, [5], "e", 0, 2, "new"))
    assert book.take(key)[-1].text == "e"
    assert not book.add(Restart("r", None, 1, "old"))  # a restart older than the current one
    assert book.add(Restart("r", None, 3, "third"))
    assert not book.add(Delta("r", None, [6], "f", 1, 2, "new"))
    assert book.add(Delta("r", None, [7], "g", 0, 3, "third"))
    assert book.add(Final("r", None, 3, "third", _row("r", "g", attempt=3)))
    assert not book.add(Delta("r", None, [8], "h", 1, 3, "third"))  # after the final: too late
    assert not book.add(Final("r", None, 2, "new", _row("r", "late", attempt=2)))
    assert [(e.type, e.attempt) for e in book.take(key)] == [("restart", 3), ("delta", 3), ("final", 3)]
    assert book.take(key) == []
    assert book.final(key).row.text == "g"  # asked again: still there


def test_the_core_sorts_events_of_many_requests_from_several_streams():
    core = ClientCore()
    reqs = core.prepare([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x", "job_id": "j"},
                         {"id": "c", "prompt": "x", "reply_to": "mqinfer:reply:own"}], None, True)
    core.remember(reqs)
    wire = Wire()
    writer = ReplyWriter("w")
    writer.delta(core.reply_to, "a", None, [104], "h", 0, 1)
    writer.delta(core.reply_to, "b", "j", [7], "x", 0, 1)
    writer.final("mqinfer:reply:own", _row("c", "own"))
    writer.send(wire)
    wire.xadd(core.reply_to, {"type": "garbage"})  # skipped, yet read past
    writer.delta(core.reply_to, "a", None, [105], "i", 1, 1)
    writer.final(core.reply_to, _row("a", "hi"))
    writer.send(wire)
    assert core.dispatch(wire.response()) == 6
    assert core.cursors == {core.reply_to: "6-0", "mqinfer:reply:own": "3-0"}
    assert [e.text if e.type == "delta" else e.row.text for e in core.replies.take((None, "a"))] == ["h", "i", "hi"]
    assert [e.text for e in core.replies.take(("j", "b"))] == ["x"]
    assert core.replies.take((None, "b")) == []  # without the job id it is another request
    assert core.replies.final((None, "c")).row.text == "own"

    # Sent again: what came for the earlier copy is void.
    core.remember(core.prepare([{"id": "a", "prompt": "x"}], None, True))
    assert core.replies.final((None, "a")) is None


def test_a_finished_request_is_remembered_up_to_keep_finals():
    book = ReplyBook(keep_finals=2)
    for rid in ("a", "b", "c"):
        book.add(Final(rid, None, 1, "w", _row(rid)))
    assert book.final((None, "a")) is None
    assert [book.final((None, r)).row.id for r in ("b", "c")] == ["b", "c"]
    book.forget((None, "b"))
    assert book.final((None, "b")) is None
    with pytest.raises(ValueError, match="keep_finals"):
        ReplyBook(keep_finals=0)


# -- waiting for results ------------------------------------------------------------------------
def test_result_reads_in_turns_and_times_out_at_its_deadline():
    clock = FakeClock(0.0)
    core = ClientCore(clock=clock)
    plan = core.result("a", None, timeout=2.5)
    cursors = {core.reply_to: "0-0"}
    assert next(plan) == TakeReadTurn(2.5)
    for remaining, block_ms in [(2.5, 1000), (1.5, 1000), (0.5, 500)]:
        if remaining != 2.5:
            assert plan.send(None) == TakeReadTurn(pytest.approx(remaining))
        assert plan.send(True) == ReadReplies(cursors, 1000, block_ms)
        clock.advance(block_ms / 1000)  # the read blocked that long and got nothing
        assert plan.send(None) == EndReadTurn()
    with pytest.raises(ResultTimeout, match="no result for request 'a' within 2.5s"):
        plan.send(None)

    # Whoever holds the turn kept it past the deadline.
    plan = core.result("a", None, timeout=1.0)
    assert next(plan) == TakeReadTurn(1.0)
    with pytest.raises(ResultTimeout):
        plan.send(False)
    # No time at all: one look, no read.
    with pytest.raises(ResultTimeout):
        next(core.result("a", None, timeout=0))
    plan = core.result("a", None, timeout=None)  # forever: reads block a second at a time
    assert next(plan) == TakeReadTurn(None)
    assert plan.send(True) == ReadReplies(cursors, 1000, 1000)


def test_result_returns_the_final_row_and_reads_on_from_where_it_stopped():
    clock = FakeClock(0.0)
    core = ClientCore(clock=clock)
    wire = Wire()
    plan = core.result("a", None, timeout=5)
    next(plan)
    assert plan.send(True) == ReadReplies({core.reply_to: "0-0"}, 1000, 1000)
    writer = ReplyWriter("w")
    writer.delta(core.reply_to, "a", None, [104], "h", 0, 1)
    writer.final(core.reply_to, _row("a", "hi"))
    writer.send(wire)
    assert plan.send(wire.response()) == EndReadTurn()
    with pytest.raises(StopIteration) as done:
        plan.send(None)
    assert done.value.value == _row("a", "hi")
    assert drive(core.result("a", None, timeout=0), lambda a: None) == _row("a", "hi")  # asked again

    plan = core.result("b", None, timeout=5)
    next(plan)
    assert plan.send(True) == ReadReplies({core.reply_to: "2-0"}, 1000, 1000)


def test_a_waiter_whose_reply_another_reader_brought_does_not_read_again():
    core = ClientCore(clock=FakeClock(0.0))
    first, second = core.result("a", None, timeout=5), core.result("b", None, timeout=5)
    assert next(first) == TakeReadTurn(5) and next(second) == TakeReadTurn(5)
    assert isinstance(first.send(True), ReadReplies)  # first got the turn; second waits for it
    wire = Wire()
    writer = ReplyWriter("w")
    writer.final(core.reply_to, _row("b", "for b"))
    writer.send(wire)
    assert first.send(wire.response()) == EndReadTurn()
    assert second.send(True) == EndReadTurn()  # its turn came with its reply already there
    with pytest.raises(StopIteration) as done:
        second.send(None)
    assert done.value.value.text == "for b"
    assert first.send(None) == TakeReadTurn(5)  # still waiting for its own


def test_on_a_cluster_each_reply_stream_is_read_on_its_own():
    core = ClientCore(cluster=True, clock=FakeClock(0.0))
    core.remember(core.prepare([{"id": "c", "prompt": "x", "reply_to": "mqinfer:reply:own"}], None, True))
    actions: list = []
    reads = iter([None, None, None, [[b"mqinfer:reply:own", [(b"1-0", {b"type": b"bad"})]]]])
    with pytest.raises(ResultTimeout):
        drive(core.result("c", None, timeout=0.1),
              lambda a: next(reads, None) if isinstance(a, ReadReplies) else True, core.clock, actions)
    assert actions[:5] == [TakeReadTurn(0.1), ReadReplies({core.reply_to: "0-0"}, 1000, None),
                           ReadReplies({"mqinfer:reply:own": "0-0"}, 1000, None), Sleep(0.05), EndReadTurn()]
    # A read that brought a message (even a malformed one) is followed by no pause.
    assert actions[5:9] == [TakeReadTurn(pytest.approx(0.05)), ReadReplies({core.reply_to: "0-0"}, 1000, None),
                            ReadReplies({"mqinfer:reply:own": "0-0"}, 1000, None), EndReadTurn()]


def test_a_stream_hands_out_batches_until_its_final_and_bounds_each_wait():
    clock = FakeClock(0.0)
    core = ClientCore(clock=clock)
    stream = core.event_stream("r", None, timeout=2)
    wire = Wire()
    old, new = ReplyWriter("old"), ReplyWriter("new")
    old.delta(core.reply_to, "r", None, [1], "a", 0, 1)
    new.restart(core.reply_to, "r", None, 2)
    old.send(wire)
    new.send(wire)
    old.delta(core.reply_to, "r", None, [2], "b", 1, 1)  # stale: dropped
    old.send(wire)
    reads = iter([wire.response()])
    batch = drive(stream.next_batch(), lambda a: next(reads) if isinstance(a, ReadReplies) else True)
    assert [(e.type, e.worker) for e in batch] == [("delta", "old"), ("restart", "new")]

    clock.advance(100)  # the timeout bounds each wait, not the whole stream
    new.delta(core.reply_to, "r", None, [5], "e", 0, 2)
    new.final(core.reply_to, _row("r", "e", attempt=2))
    new.send(wire)
    reads = iter([wire.response()])
    batch = drive(stream.next_batch(), lambda a: next(reads) if isinstance(a, ReadReplies) else True)
    assert [e.type for e in batch] == ["delta", "final"] and batch[-1].row.text == "e"
    actions: list = []
    assert drive(stream.next_batch(), lambda a: None, log=actions) == [] and actions == []

    silent = core.event_stream("quiet", None, timeout=0.5)
    with pytest.raises(ResultTimeout, match="no message for request 'quiet' within 0.5s"):
        drive(silent.next_batch(), lambda a: clock.advance(0.5) if isinstance(a, ReadReplies) else True)


def test_requests_sent_without_a_reply_stream_have_no_result_to_wait_for():
    core = ClientCore(clock=FakeClock())
    core.remember(core.prepare([{"id": "g", "prompt": "x"}], None, False))
    with pytest.raises(NoReplyStream, match="'g' was submitted without a reply stream"):
        next(core.result("g", None, timeout=5))
    with pytest.raises(NoReplyStream):
        next(core.event_stream("g", None, timeout=5).next_batch())
    core.remember(core.prepare([{"id": "g", "prompt": "x"}], None, True))  # sent again, with one
    assert next(core.result("g", None, timeout=5)) == TakeReadTurn(5)


# -- cancel and close ---------------------------------------------------------------------------
def test_cancel_goes_to_the_cancel_set_of_the_request_s_shard_and_close_deletes_the_reply_stream():
    core = ClientCore(stream="s", shards=4, cancel_ttl_s=600, route="id")
    actions: list = []
    drive(core.cancel("r7", "j"), lambda a: None, log=actions)
    shard = core.shard_of("r7", "j")
    assert actions == [AddCancel(cancel_key(f"s-{shard}"), cancel_member("r7", "j"), 600)]
    assert cancel_key(f"s-{shard}") == f"mqinfer:{{s-{shard}}}:cancel"
    # Routed by prefix, the request may be on any shard: every shard's set gets it.
    routed = ClientCore(stream="s", shards=4, cancel_ttl_s=600)
    actions = []
    drive(routed.cancel("r7", "j"), lambda a: None, log=actions)
    assert actions == [AddCancel(cancel_key(f"s-{i}"), cancel_member("r7", "j"), 600) for i in range(4)]

    actions = []
    gone = redis.exceptions.ConnectionError("server went away")
    assert drive(core.close(True), lambda a: gone, log=actions) is None  # it expires on its own
    assert actions == [DeleteStream(core.reply_to)]
    actions = []
    drive(core.close(False), lambda a: None, log=actions)
    assert actions == []

