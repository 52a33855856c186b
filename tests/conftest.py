"""Shared fixtures: a real embedded Redis-compatible server for the whole session."""

from __future__ import annotations

import os

import pytest

from mqinfer.server import EmbeddedServer


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject.toml): one test process per core, plus one. Many tests spend part of
    their time waiting on worker subprocesses and sockets; the extra process keeps the cores busy
    meanwhile (on 2 cores: 4m25s against 4m49s). ``--maxprocesses`` still caps it, and
    PYTEST_XDIST_AUTO_NUM_WORKERS still sets it."""
    from mqinfer.layout import usable_cores

    explicit = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    return int(explicit) if explicit else usable_cores() + 1


@pytest.fixture(scope="session", autouse=True)
def prepared_models_in_a_session_folder(tmp_path_factory):
    """Models that engines prepare and keep for their next start (workers/prepared.py) go to this
    test session's own folder, not the user's cache (worker subprocesses inherit the setting)."""
    os.environ.setdefault("MQINFER_PREPARED_CACHE_DIR", str(tmp_path_factory.mktemp("prepared")))
    yield


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
