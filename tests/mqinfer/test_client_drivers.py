"""The blocking and asyncio drivers of the client core against a real server: many waiters share one
read turn, timeouts hold while another waiter reads, and a failed read hands the turn back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis.exceptions

from mqinfer.client import AsyncClient, Client, Delta, Final, ReplyWriter, ResultTimeout
from mqinfer.schemas.rows import ResultRow
from tests.helpers import blocked_in, wait_until

BROKEN = "mqinfer:reply:broken"


def _row(rid: str, text: str = "hi") -> ResultRow:
    return ResultRow(job_id=None, id=rid, model="tiny", finish_reason="length", prompt_tokens=1, output_tokens=1,
                     output_token_ids=[104], text=text, enqueued_at=1.0, finished_at=2.0, worker="w", attempt=1)


def test_many_threads_wait_on_one_client(redis_url, redis_client):
    with Client(redis_url) as client:
        ids = client.submit_many([{"id": f"t{i}", "prompt": "x"} for i in range(8)] + [{"id": "s", "prompt": "x"}])
        texts: dict[str, str] = {}
        streamed: list = []
        failures: list[BaseException] = []
        timed_out: list[float] = []

        def wait(rid: str) -> None:
            try:
                texts[rid] = client.result(rid, timeout=20).text
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                failures.append(exc)

        def stream() -> None:
            streamed.extend(client.stream("s", timeout=20))

        def nobody() -> None:  # times out on its own deadline while others hold the read turn
            started = time.monotonic()
            try:
                client.result("missing", timeout=0.3)
            except ResultTimeout:
                timed_out.append(time.monotonic() - started)

        threads = [threading.Thread(target=wait, args=(rid,)) for rid in ids[:8]]
        threads += [threading.Thread(target=stream), threading.Thread(target=nobody)]
        for thread in threads:
            thread.start()
        # The replies are sent once one thread holds the read turn, blocked in XREAD.
        wait_until(lambda: blocked_in(redis_client, "xread"), timeout=10, what="a reader blocked in XREAD")
        writer = ReplyWriter("w")
        writer.delta(client.reply_to, "s", None, [104], "h", 0, 1)
        for rid in reversed(ids):
            writer.final(client.reply_to, _row(rid, f"text-{rid}"))
        writer.send(redis_client)
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads)
    assert failures == []
    assert texts == {rid: f"text-{rid}" for rid in ids[:8]}
    assert [type(e) for e in streamed] == [Delta, Final] and streamed[-1].row.text == "text-s"
    assert len(timed_out) == 1 and 0.25 <= timed_out[0] < 0.9


def _broken_then_fixed(redis_client, reply_to: str) -> ReplyWriter:
    writer = ReplyWriter("w")
    writer.final(reply_to, _row("usual", "u"))
    writer.final(BROKEN, _row("own", "o"))
    return writer


def test_a_failed_read_hands_the_read_turn_back(redis_url, redis_client):
    with Client(redis_url) as client:
        client.submit_many([{"id": "own", "prompt": "x", "reply_to": BROKEN}, {"id": "usual", "prompt": "x"}])
        redis_client.set(BROKEN, "not a stream")
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            client.result("usual", timeout=5)
        redis_client.delete(BROKEN)
        _broken_then_fixed(redis_client, client.reply_to).send(redis_client)
        # Had the failed read kept the turn, these would time out waiting for it.
        assert client.result("usual", timeout=5).text == "u"
        assert client.result("own", timeout=5).text == "o"


def test_the_async_client_hands_the_read_turn_back_after_a_failed_read(redis_url, redis_client):
    async def main():
        async with AsyncClient(redis_url) as client:
            await client.submit_many([{"id": "own", "prompt": "x", "reply_to": BROKEN},
                                      {"id": "usual", "prompt": "x"}])
            redis_client.set(BROKEN, "not a stream")
            with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
                await client.result("usual", timeout=5)
            redis_client.delete(BROKEN)
            _broken_then_fixed(redis_client, client.reply_to).send(redis_client)
            return await asyncio.gather(client.result("usual", timeout=5), client.result("own", timeout=5))

    usual, own = asyncio.run(main())
    assert (usual.text, own.text) == ("u", "o")


def test_a_cancelled_async_waiter_hands_the_read_turn_back(redis_url, redis_client):
    async def main():
        async with AsyncClient(redis_url) as client:
            await client.submit({"id": "a", "prompt": "x"})
            others = blocked_in(redis_client, "xread")  # readers left by earlier tests on this server
            reader = asyncio.create_task(client.result("a", timeout=20))
            await asyncio.to_thread(wait_until, lambda: blocked_in(redis_client, "xread") > others, timeout=10,
                                    what="the reader to hold the read turn, blocked in XREAD")
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            writer = ReplyWriter("w")
            writer.final(client.reply_to, _row("a", "after"))
            await asyncio.to_thread(writer.send, redis_client)
            started = time.monotonic()
            row = await client.result("a", timeout=5)
            return row, time.monotonic() - started

    row, waited = asyncio.run(main())
    assert row.text == "after" and waited < 2.0


def test_a_waiter_cancelled_as_the_read_turn_comes_free_does_not_keep_it(redis_url):
    async def main():
        async with AsyncClient(redis_url) as client:
            turn = client._read_lock
            await turn.acquire()  # another coroutine holds the read turn
            waiter = asyncio.create_task(client.result("a", timeout=20))
            await asyncio.sleep(0.05)  # the waiter now waits for the turn
            turn.release()
            waiter.cancel()  # in the same moment as the turn comes free
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(waiter, 5)
            return turn.locked()

    assert asyncio.run(main()) is False


def test_a_waiter_cancelled_at_any_moment_raises_cancelled_error(redis_url):
    """Cancelled as it starts, mid-call or between calls: the waiter raises CancelledError and
    hands the read turn back. (On Python 3.11, redis-py writes each command under
    asyncio.wait_for, which drops a cancellation that lands as the write completes: a few percent
    of the cancels right after the waiter starts; the waiter then read on until its timeout.)"""
    async def main():
        outcomes = []
        async with AsyncClient(redis_url) as client:
            await client.submit({"id": "a", "prompt": "x"})
            for k in range(60):
                waiter = asyncio.create_task(client.result("a", timeout=2))
                await asyncio.sleep(0 if k % 3 else 0.001 * (k % 7))
                waiter.cancel()
                try:
                    await waiter
                    outcomes.append("returned")
                except asyncio.CancelledError:
                    outcomes.append("cancelled")
                except Exception as exc:
                    outcomes.append(type(exc).__name__)
            return outcomes, client._read_lock.locked()

    outcomes, locked = asyncio.run(main())
    assert outcomes == ["cancelled"] * 60 and not locked
