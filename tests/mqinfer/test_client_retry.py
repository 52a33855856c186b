"""A request submitted again (a retry from another client, or the same client resubmitting) is
answered on its own reply stream without being computed again, and a copy with other content gets
a prompt ``duplicate_id`` error answer: against a real server and a real worker process."""

from __future__ import annotations

import signal

import pytest

from mqinfer.schemas import keys
from mqinfer.client import Client, Delta
from tests.helpers import rows, start_worker, wait_exit, wait_until

STREAM = "client-retry"
# A duplicate is answered within a flush interval or two; far less than a ResultTimeout's wait.
PROMPT_S = 15


@pytest.fixture(scope="module")
def served(redis_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("client-retry")
    worker = start_worker(redis_server.url, out, "--stream", STREAM, "--flush-interval-s", "0.05")
    yield redis_server.url, out
    worker.terminate()
    code, err = wait_exit(worker, timeout=60)
    assert code == 0, err


def _client(url: str) -> Client:
    return Client(url, stream=STREAM)


def _rows_of(out, request_id: str) -> list[dict]:
    return [r for r in rows(out / "results") if r["id"] == request_id]


def _same(a, b) -> None:
    assert (a.finish_reason, a.output_token_ids, a.text, a.attempt, a.worker, a.finished_at) == \
        (b.finish_reason, b.output_token_ids, b.text, b.attempt, b.worker, b.finished_at)


def _marker(client: Client, name: str) -> None:
    """A request read after everything sent before it: once its row is back, the worker has dealt
    with every earlier entry."""
    client.submit({"id": name, "prompt": "m", "max_tokens": 1})
    assert client.result(name, timeout=120).finish_reason == "length"


def test_a_finished_request_submitted_again_gets_its_row_without_a_second_one(served, redis_server):
    url, out = served
    request = {"id": "retry-1", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
               "metadata": {"k": "v"}}
    with _client(url) as first, _client(url) as second:
        original = first.result(first.submit(request), timeout=120)
        assert (original.finish_reason, original.output_tokens) == ("length", 6)
        # Another client, another reply stream and another priority: the same request.
        second.submit({**request, "priority": 3})
        again = second.result("retry-1", timeout=PROMPT_S)
        _same(again, original)
        assert again.metadata == {"k": "v"}
        # The first client resubmits it as well.
        first.submit(request)
        _same(first.result("retry-1", timeout=PROMPT_S), original)
        _marker(first, "retry-1-marker")
    assert len(_rows_of(out, "retry-1")) == 1
    # Every copy's entry is acked. The marker's own reply goes out just before its entry's ack, so
    # its entry may still be pending for a moment; an entry that is never acked fails the wait.
    client = redis_server.client()
    wait_until(lambda: client.xpending(keys.request_stream(STREAM), keys.GROUP)["pending"] == 0,
               timeout=PROMPT_S, what="every entry acked")


def test_a_copy_of_a_running_request_gets_its_row_when_it_finishes(served):
    url, out = served
    request = {"id": "retry-2", "prompt": "long", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with _client(url) as first, _client(url) as second:
        first.submit(request)
        assert isinstance(next(iter(first.stream("retry-2", timeout=120))), Delta)  # it runs
        second.submit(request)
        original = first.result("retry-2", timeout=120)
        again = second.result("retry-2", timeout=PROMPT_S)
        assert (original.finish_reason, original.output_tokens) == ("length", 200)
        _same(again, original)
        _marker(first, "retry-2-marker")
    assert len(_rows_of(out, "retry-2")) == 1


def test_a_copy_with_other_content_gets_a_prompt_duplicate_id_answer(served, redis_server):
    url, out = served
    request = {"id": "retry-3", "prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with _client(url) as first, _client(url) as second:
        assert first.result(first.submit(request), timeout=120).output_tokens == 4
        second.submit({**request, "max_tokens": 5})
        refused = second.result("retry-3", timeout=PROMPT_S)
        _marker(first, "retry-3-marker")
    assert (refused.finish_reason, refused.error_code) == ("error", "duplicate_id")
    assert "'retry-3'" in refused.error and "different content" in refused.error
    assert refused.output_tokens == 0
    # The dataset keeps the first copy's row only; the refused copy is a dead letter.
    [row] = _rows_of(out, "retry-3")
    assert (row["finish_reason"], row["output_tokens"]) == ("length", 4)
    dead = redis_server.client().xrange(keys.dead_letter_stream(STREAM))
    codes = [(f[b"error_code"], b"'retry-3'" in f[b"error"]) for _, f in dead]
    assert codes == [(b"duplicate_id", True)]


def test_duplicates_are_answered_under_the_least_privilege_acl_users(tmp_path):
    """The worker's user of ops/acl/users.acl may not DEL or read sets: answering duplicates needs
    nothing it lacks."""
    from tests.faults.faultkit import spawn
    from tests.hostile.test_least_privilege import AclServer

    server = AclServer(tmp_path / "redis")
    worker = None
    try:
        worker = spawn(server.url("worker"), tmp_path / "out", "W")
        request = {"id": "acl-retry", "prompt": "p", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        with Client(server.url("producer")) as first, Client(server.url("producer")) as second:
            first.submit(request)
            assert isinstance(next(iter(first.stream("acl-retry", timeout=120))), Delta)
            second.submit(request)  # while the first copy runs
            original = first.result("acl-retry", timeout=120)
            _same(second.result("acl-retry", timeout=PROMPT_S), original)
            first.submit(request)  # after it finished
            _same(first.result("acl-retry", timeout=PROMPT_S), original)
            second.submit({**request, "max_tokens": 3})
            assert second.result("acl-retry", timeout=PROMPT_S).error_code == "duplicate_id"
        admin = server.client("admin")
        denied = [e for e in admin.execute_command("ACL", "LOG", "100") if e[b"username"] in (b"worker", b"producer")]
        assert denied == []
    finally:
        try:
            if worker is not None:
                worker.signal(signal.SIGTERM)
                assert worker.wait() == 0, worker.log()
        finally:
            server.stop()  # also when the worker failed: no server outlives the test
    assert "NOPERM" not in worker.log()
    assert [r["id"] for r in rows(tmp_path / "out" / "results")] == ["acl-retry"]
