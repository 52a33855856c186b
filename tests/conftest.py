"""Shared fixtures: a real embedded Redis-compatible server for the whole session."""

from __future__ import annotations

import pytest

from mqinfer.server import EmbeddedServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The server's URL, emptied for this test."""
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url, redis_server):
    client = redis_server.client()
    yield client
    client.close()
