"""The producer client against a real server, no worker: validation, backpressure, timeouts, the
reply-stream protocol (written with the worker's ReplyWriter, read back by the clients), cancel."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from mqinfer.schemas import keys
from mqinfer.client import (
    AsyncClient,
    BackpressureError,
    Client,
    Delta,
    Final,
    NoReplyStream,
    Producer,
    ReplyWriter,
    RequestError,
    Restart,
    ResultTimeout,
    cancel_key,
    cancel_member,
    parse_reply,
)
from mqinfer.schemas.rows import ResultRow
from mqinfer.schemas.stream import decode_entry
from tests.helpers import blocked_in, wait_until

STREAM = keys.request_stream("requests")


def _row(rid: str, text: str = "hi", job_id: str | None = None, attempt: int = 1) -> ResultRow:
    return ResultRow(job_id=job_id, id=rid, model="tiny", finish_reason="length", prompt_tokens=3,
                     output_tokens=2, output_token_ids=[104, 105], text=text, enqueued_at=1.0, started_at=1.5,
                     first_token_at=1.6, finished_at=2.0, worker="w1", attempt=attempt, metadata={"k": "v"})


def test_submit_sets_reply_to_and_validates_before_sending(redis_url, redis_client):
    with Client(redis_url) as client:
        assert client.reply_to.startswith("mqinfer:reply:")
        assert client.submit({"id": "a", "prompt": "x", "max_tokens": 3}) == "a"
        (_, fields), = redis_client.xrange(STREAM)
        req = decode_entry(fields)
        assert (req.id, req.max_tokens, req.reply_to) == ("a", 3, client.reply_to)
        assert redis_client.xinfo_groups(STREAM)[0]["name"] == keys.GROUP.encode()

        # One bad request in a batch: nothing of the batch is sent, and the error names the field.
        with pytest.raises(RequestError) as info:
            client.submit_many([{"id": "b", "prompt": "x"}, {"id": "c", "prompt": "x", "max_tokens": "many"}])
        assert info.value.code == "invalid_request"
        assert "max_tokens" in info.value.message and "'c'" in info.value.message
        with pytest.raises(RequestError, match="colour"):
            client.submit({"id": "d", "prompt": "x", "colour": "blue"})
        with pytest.raises(RequestError, match="reply_to"):
            client.submit({"id": "e", "prompt": "x", "reply_to": "elsewhere"})
        with pytest.raises(RequestError, match="appears twice"):
            client.submit_many([{"id": "f", "prompt": "x"}, {"id": "f", "prompt": "y"}])
        assert redis_client.xlen(STREAM) == 1

        # reply=False leaves reply_to unset; asking for its result is then a clear error.
        client.submit({"id": "g", "prompt": "x"}, reply=False)
        assert decode_entry(redis_client.xrange(STREAM)[-1][1]).reply_to is None
        with pytest.raises(NoReplyStream, match="'g'"):
            client.result("g", timeout=0.1)


def test_submit_many_pipelines_and_stamps_job_id(redis_url, redis_client):
    with Client(redis_url) as client:
        ids = client.submit_many(({"id": f"r{i}", "prompt_token_ids": [1, 2]} for i in range(1200)),
                                 job_id="job-7", chunk_size=500)
    assert ids == [f"r{i}" for i in range(1200)]
    entries = redis_client.xrange(STREAM)
    assert len(entries) == 1200
    assert {decode_entry(f).job_id for _, f in entries} == {"job-7"}


def test_producer_still_works_as_the_low_level_class(redis_url, redis_client):
    producer = Producer(redis_url)
    entry_id = producer.submit({"id": "p", "prompt": "x"})
    assert redis_client.xrange(STREAM)[0][0].decode() == entry_id
    assert producer.submit_many([{"id": "q", "prompt": "y"}], job_id="j") == 1
    assert decode_entry(redis_client.xrange(STREAM)[-1][1]).reply_to is None


def test_backpressure_raises_or_waits_for_the_backlog_to_fall(redis_url, redis_client):
    with Client(redis_url, max_backlog=3, backpressure="raise") as client:
        client.submit_many([{"id": f"a{i}", "prompt": "x"} for i in range(3)])
        assert client.backlog() == 3
        with pytest.raises(BackpressureError, match="backlog of 3 requests \\(limit 3\\)"):
            client.submit({"id": "over", "prompt": "x"})
        assert redis_client.xlen(STREAM) == 3
        # Read but unacked entries still count; acked (and deleted, as workers do) ones do not.
        got = redis_client.xreadgroup(keys.GROUP, "c1", {STREAM: ">"}, count=2)
        assert client.backlog() == 3
        first = got[0][1][0][0]
        redis_client.xack(STREAM, keys.GROUP, first)
        redis_client.xdel(STREAM, first)
        assert client.backlog() == 2
        client.submit({"id": "fits", "prompt": "x"})

    with Client(redis_url, max_backlog=3, backpressure="wait", backpressure_timeout_s=0.3) as client:
        started = time.monotonic()
        with pytest.raises(BackpressureError, match="after waiting"):
            client.submit({"id": "late", "prompt": "x"})
        assert time.monotonic() - started >= 0.3

    stop = threading.Event()
    finished: list[str] = []

    def consumer():  # finishes requests a little later, as a worker would: read, ack, delete
        # The delay is the point: the client must find the backlog full and wait for room.
        time.sleep(0.3)
        position = "0"  # first what c1 already holds, then new entries
        while not stop.is_set():
            for _, entries in redis_client.xreadgroup(keys.GROUP, "c1", {STREAM: position}, block=50) or []:
                for entry_id, fields in entries:
                    finished.append(decode_entry(fields).id)
                    redis_client.xack(STREAM, keys.GROUP, entry_id)
                    redis_client.xdel(STREAM, entry_id)
            position = ">"

    with Client(redis_url, max_backlog=3, backpressure="wait", backpressure_timeout_s=10) as client:
        thread = threading.Thread(target=consumer)
        thread.start()
        started = time.monotonic()
        try:
            # Five requests, never more than three unfinished: sent in chunks as room frees.
            client.submit_many([{"id": f"w{i}", "prompt": "x"} for i in range(5)], chunk_size=500)
            assert time.monotonic() - started >= 0.25
            wait_until(lambda: len(finished) >= 8, timeout=5)
        finally:
            stop.set()
            thread.join()
    assert finished[-5:] == [f"w{i}" for i in range(5)]


def test_result_times_out_clearly_without_a_worker(redis_url):
    with Client(redis_url) as client:
        client.submit({"id": "nobody", "prompt": "x"})
        started = time.monotonic()
        with pytest.raises(ResultTimeout, match="'nobody' within 0.3s"):
            client.result("nobody", timeout=0.3)
        assert 0.25 <= time.monotonic() - started < 2.0
        with pytest.raises(TimeoutError):  # ResultTimeout is a TimeoutError too
            next(iter(client.stream("nobody", timeout=0.2)))


def test_reply_protocol_round_trip_through_the_server(redis_url, redis_client):
    with Client(redis_url) as client:
        client.submit_many([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x", "job_id": "j"}])
        writer = ReplyWriter("w1", maxlen=1000, ttl_s=120)
        key = client.reply_to
        writer.delta(key, "a", None, [104], "h", 0, 1)
        writer.delta(key, "b", "j", [7, 8], "xy", 0, 1)
        writer.delta(key, "a", None, [105], "i", 1, 1)
        writer.final(key, _row("a", "hi"))
        assert writer.send(redis_client) == 4 and len(writer) == 0
        assert 0 < redis_client.ttl(key) <= 120

        events = list(client.stream("a", timeout=5))
        assert [e.type for e in events] == ["delta", "delta", "final"]
        assert "".join(e.text for e in events[:-1]) == "hi" == events[-1].row.text
        assert [e.index for e in events[:-1]] == [0, 1]
        assert events[-1].row == _row("a", "hi")
        assert client.result("a", timeout=1) == _row("a", "hi")  # asked again: still there
        # Request b (with a job id) kept its own events meanwhile.
        writer.final(key, _row("b", "xy", job_id="j"))
        writer.send(redis_client)
        assert client.result("b", timeout=5, job_id="j").text == "xy"
        with pytest.raises(ResultTimeout):
            client.result("b", timeout=0.1)  # without the job id it is another request


def test_a_request_may_name_its_own_reply_stream(redis_url, redis_client):
    with Client(redis_url) as client:
        client.submit_many([{"id": "own", "prompt": "x", "reply_to": "mqinfer:reply:elsewhere"},
                            {"id": "usual", "prompt": "x"}])
        writer = ReplyWriter("w")
        writer.final("mqinfer:reply:elsewhere", _row("own", "o"))
        writer.final(client.reply_to, _row("usual", "u"))
        writer.send(redis_client)
        # One read covers both streams.
        assert client.result("own", timeout=5).text == "o"
        assert client.result("usual", timeout=5).text == "u"


def test_restart_discards_and_stale_deltas_are_dropped(redis_url, redis_client):
    with Client(redis_url) as client:
        client.submit({"id": "r", "prompt": "x"})
        key = client.reply_to
        old, new = ReplyWriter("old"), ReplyWriter("new")
        old.delta(key, "r", None, [1], "a", 0, 1)
        old.send(redis_client)
        new.restart(key, "r", None, 2)
        new.delta(key, "r", None, [5], "e", 0, 2)
        new.send(redis_client)
        old.delta(key, "r", None, [2], "b", 1, 1)  # the old worker has not noticed yet: stale
        old.send(redis_client)
        new.delta(key, "r", None, [6], "f", 1, 2)
        new.final(key, _row("r", "ef", attempt=2))
        new.send(redis_client)
        events = list(client.stream("r", timeout=5))
    assert [(e.type, getattr(e, "text", None)) for e in events] == [
        ("delta", "a"), ("restart", None), ("delta", "e"), ("delta", "f"), ("final", None)]
    assert events[1] == Restart("r", None, 2, "new")
    assert "".join(e.text for e in events[2:-1]) == events[-1].row.text == "ef"


def test_reply_streams_are_capped_and_the_writer_keeps_finals_when_buffer_overflows(redis_url, redis_client):
    writer = ReplyWriter("w", maxlen=10, ttl_s=60)
    key = "mqinfer:reply:capped"
    for i in range(1000):
        writer.delta(key, "x", None, [i], "", i, 1)
    writer.send(redis_client)
    # Approximate trimming removes whole internal nodes (100 entries each by default).
    assert 10 <= redis_client.xlen(key) <= 10 + 100

    small = ReplyWriter("w", max_buffered=3)
    small.delta(key, "x", None, [1], "a", 0, 1)
    small.final(key, _row("x"))
    small.delta(key, "y", None, [1], "a", 0, 1)
    small.restart(key, "z", None, 2)
    assert len(small) == 3 and small.dropped == 1
    small.delta(key, "y", None, [2], "b", 1, 1)
    kinds = [fields["type"] for _, fields in small._buffer]
    assert kinds == ["final", "restart", "delta"]


def test_parse_reply_rejects_malformed_messages_and_the_client_skips_them(redis_url, redis_client):
    with pytest.raises(ValueError, match="without field 'id'"):
        parse_reply({b"type": b"delta"})
    with pytest.raises(ValueError, match="unknown type"):
        parse_reply({b"type": b"nope", b"id": b"x"})
    with pytest.raises(ValueError, match="malformed"):
        parse_reply({b"type": b"delta", b"id": b"x", b"token_ids": b"[1,", b"index": b"0"})
    with Client(redis_url) as client:
        client.submit({"id": "s", "prompt": "x"})
        redis_client.xadd(client.reply_to, {"type": "garbage"})
        writer = ReplyWriter("w")
        writer.final(client.reply_to, _row("s"))
        writer.send(redis_client)
        assert client.result("s", timeout=5).id == "s"


def test_cancel_records_the_request_with_the_server_time(redis_url, redis_client):
    with Client(redis_url, stream="other", cancel_ttl_s=600) as client:
        before = time.time()
        client.cancel("a")
        client.cancel("b", job_id="j")
        key = cancel_key("other")
        assert key == "mqinfer:{other}:cancel"
        scores = redis_client.zmscore(key, [cancel_member("a", None), cancel_member("b", "j"), cancel_member("b", None)])
        assert scores[2] is None
        assert all(abs(s - before) < 5 for s in scores[:2])
        assert 0 < redis_client.ttl(key) <= 600
        assert msgspec.json.decode(cancel_member("b", "j")) == ["j", "b"]


def test_sharded_client_spreads_requests_by_a_stable_hash(redis_url, redis_client):
    with Client(redis_url, stream="s", shards=3) as client:
        assert client.stream_keys == ["mqinfer:{s-0}", "mqinfer:{s-1}", "mqinfer:{s-2}"]
        client.submit_many([{"id": f"r{i}", "prompt": "x"} for i in range(300)])
        counts = [redis_client.xlen(k) for k in client.stream_keys]
        assert sum(counts) == 300 and min(counts) > 60
        again = Client(redis_url, stream="s", shards=3)
        for key in client.stream_keys:
            for _, fields in redis_client.xrange(key):
                rid = decode_entry(fields).id
                assert again.stream_keys[again._core.shard_of(rid, None)] == key
        again.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"backpressure": "drop"}, "backpressure"),
    ({"max_backlog": 0}, "max_backlog"),
    ({"fmt": "xml"}, "fmt"),
    ({"reply_to": "not-a-reply-key"}, "reply_to"),
    ({"shards": 0}, "shards"),
    ({"stream": "a}b"}, "stream"),
])
def test_client_arguments_are_validated(redis_url, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Client(redis_url, **kwargs)


def test_async_client_submits_streams_and_waits_concurrently(redis_url, redis_client):
    async def main():
        async with AsyncClient(redis_url, max_backlog=100) as client:
            ids = await client.submit_many([{"id": f"a{i}", "prompt": "x"} for i in range(5)])
            assert ids == [f"a{i}" for i in range(5)]
            with pytest.raises(RequestError, match="temperature"):
                await client.submit({"id": "bad", "prompt": "x", "temperature": -1})
            waiters = [asyncio.create_task(client.result(i, timeout=10)) for i in ids]

            async def stream_a0():
                return [e async for e in client.stream("a0", timeout=10)]

            streamer = asyncio.create_task(stream_a0())
            # The replies are sent once a reader is blocked in XREAD, so that they reach waiting readers.
            await asyncio.to_thread(wait_until, lambda: blocked_in(redis_client, "xread"), timeout=10,
                                    what="a reader blocked in XREAD")
            writer = ReplyWriter("w")
            writer.delta(client.reply_to, "a0", None, [104], "h", 0, 1)
            for i in reversed(ids):
                writer.final(client.reply_to, _row(i, f"t-{i}"))
            await asyncio.to_thread(writer.send, redis_client)
            rows = await asyncio.gather(*waiters)
            events = await streamer
            with pytest.raises(ResultTimeout):
                await client.result("a1-missing", timeout=0.2)
            assert await client.backlog() == 5
            return rows, events

    rows, events = asyncio.run(main())
    assert [r.text for r in rows] == [f"t-a{i}" for i in range(5)]
    assert isinstance(events[0], Delta) and isinstance(events[-1], Final) and events[-1].row.text == "t-a0"
    assert redis_client.xlen(STREAM) == 5


def test_async_backpressure_raises(redis_url):
    async def main():
        async with AsyncClient(redis_url, max_backlog=2, backpressure="raise") as client:
            await client.submit_many([{"id": "x1", "prompt": "x"}, {"id": "x2", "prompt": "x"}])
            with pytest.raises(BackpressureError):
                await client.submit({"id": "x3", "prompt": "x"})

    asyncio.run(main())


def test_the_client_does_not_import_torch():
    code = ("import sys, mqinfer.client, mqinfer.cluster\n"
            "print(','.join(m for m in ('torch', 'triton', 'tokenizers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_a_final_with_choices_and_deltas_of_each_choice(redis_url, redis_client):
    with Client(redis_url) as client:
        client.submit({"id": "n", "prompt": "x", "n": 2})
        writer = ReplyWriter("w1", maxlen=1000, ttl_s=120)
        key = client.reply_to
        writer.delta(key, "n", None, [104], "h", 0, 1)
        writer.delta(key, "n", None, [105], "i", 0, 1, choice=1)
        rows = [msgspec.structs.replace(_row("n", "h"), index=0), msgspec.structs.replace(_row("n", "i"), index=1)]
        writer.final(key, rows[0], rows)
        writer.send(redis_client)
        raw = [fields for _, fields in redis_client.xrange(key)]
        assert b"choice" not in raw[0] and raw[1][b"choice"] == b"1"  # choice 0 is left out, as before
        events = list(client.stream("n", timeout=5))
        assert [(e.type, getattr(e, "choice", None)) for e in events] == [("delta", 0), ("delta", 1), ("final", None)]
        assert events[-1].rows == rows and events[-1].row == rows[0]
        assert client.choices("n", timeout=1) == rows and client.result("n", timeout=1) == rows[0]
        # One choice: the final carries no choices field, and its rows are just its row.
        writer.final(key, _row("one", "z"), [_row("one", "z")])
        writer.send(redis_client)
        assert b"choices" not in redis_client.xrange(key)[-1][1]
        assert client.choices("one", timeout=5) == [_row("one", "z")]
