"""The Redis tier against a real server: sharing, isolation, publish-once, and every fault as a miss."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from offload_helpers import META, key, payload
from offload_redis import RedisServer

from kvserve.kv_offload.format import encode_block, make_header
from kvserve.kv_offload.redis_tier import RedisTier, mask_url
from kvserve.kv_offload.tier import BlockMeta, KVTier

Factory = Callable[..., RedisServer]


def fast_tier(url: str, meta: BlockMeta = META, **kwargs: object) -> RedisTier:
    """A tier with short waits, so fault tests stay quick."""
    opts: dict[str, object] = {"timeout_s": 0.2, "backoff_initial_s": 0.2, "backoff_max_s": 0.8}
    opts.update(kwargs)
    return RedisTier(url, meta, **opts)  # type: ignore[arg-type]


def test_store_load_contains_round_trip(redis_url: str) -> None:
    tier = fast_tier(redis_url)
    assert isinstance(tier, KVTier)
    for i in (0, 1, 3):
        assert tier.store(key(i), payload(i))
    assert tier.contains([key(0), key(1), key(2), key(3)]) == 2
    assert tier.contains([key(3)]) == 1 and tier.contains([]) == 0
    assert [tier.load(key(i)) for i in range(4)] == [payload(0), payload(1), None, payload(3)]
    s = tier.stats
    assert (s.stores, s.queries, s.hits, s.loads, s.load_misses) == (3, 5, 3, 4, 1)
    assert (s.bytes_stored, s.bytes_loaded, s.errors) == (3 * META.nbytes, 3 * META.nbytes, {})
    assert s.load_seconds > 0 and tier.speed.samples == 3
    assert 0 < tier.estimate_load_seconds(META.nbytes) < 0.2
    raw = tier.client.get(b"kvserve:" + key(0).hex().encode())
    assert isinstance(raw, bytes) and raw.startswith(b"KVB1") and raw.endswith(payload(0))
    tier.close()
    assert tier.load(key(0)) is None and not tier.store(key(5), payload(5))
    assert tier.stats.errors == {"off": 2}


def test_two_instances_share_blocks_and_prefixes_isolate(redis_url: str) -> None:
    a, b = fast_tier(redis_url), fast_tier(redis_url)
    other_deployment = fast_tier(redis_url, prefix="staging:")
    assert a.store(key(0), payload(0)) and a.store(key(1), payload(1))
    assert b.contains([key(0), key(1), key(2)]) == 2
    assert b.load(key(1)) == payload(1)
    assert other_deployment.contains([key(0)]) == 0 and other_deployment.load(key(0)) is None
    assert other_deployment.store(key(0), payload(7))
    assert other_deployment.load(key(0)) == payload(7) and a.load(key(0)) == payload(0)
    assert sorted(a.client.keys("*")) == sorted([b"kvserve:" + key(0).hex().encode(),
                                                 b"kvserve:" + key(1).hex().encode(),
                                                 b"staging:" + key(0).hex().encode()])


def test_publish_once_and_ttl_and_read_only(redis_url: str) -> None:
    a, b = fast_tier(redis_url), fast_tier(redis_url, ttl_s=30)
    assert a.store(key(0), payload(0))
    assert b.store(key(0), payload(9))  # there already: True, nothing written (NX)
    assert b.load(key(0)) == payload(0)
    assert (a.stats.stores, b.stats.stores, b.stats.already_present, b.stats.bytes_stored) == (1, 0, 1, 0)
    assert a.client.ttl(a.redis_key(key(0))) == -1  # no TTL by default
    assert b.store(key(1), payload(1))
    assert 29_000 < b.client.pttl(b.redis_key(key(1))) <= 30_000
    reader = fast_tier(redis_url, publish=False)
    assert not reader.store(key(2), payload(2)) and a.client.exists(a.redis_key(key(2))) == 0
    assert reader.load(key(1)) == payload(1)


def test_values_that_fail_validation_are_misses_by_kind(redis_url: str) -> None:
    tier = fast_tier(redis_url)
    direct = redis.Redis.from_url(redis_url)
    # A damaged value: one payload byte flipped.
    assert tier.store(key(0), payload(0))
    raw = bytearray(direct.get(tier.redis_key(key(0))))  # type: ignore[arg-type]
    raw[-3] ^= 0x10
    direct.set(tier.redis_key(key(0)), bytes(raw))
    assert tier.load(key(0)) is None
    assert tier.stats.errors == {"checksum": 1}
    assert direct.exists(tier.redis_key(key(0))) == 0  # repaired: removed, so a good copy can be published
    assert tier.store(key(0), payload(0)) and tier.load(key(0)) == payload(0)
    # Values written by another model and with another KV dtype, under this model's keys.
    other_model = BlockMeta("fp-model-b", META.dtype, META.block_size, META.shape)
    other_dtype = BlockMeta(META.fingerprint, "bfloat16", META.block_size, (2, 2, 4, 1, 16))
    for i, meta in ((1, other_model), (2, other_dtype)):
        direct.set(tier.redis_key(key(i)), encode_block(make_header(key(i), meta, payload(i, meta)),
                                                        payload(i, meta)))
    direct.set(tier.redis_key(key(3)), b"not a block at all")
    direct.set(tier.redis_key(key(4)), encode_block(make_header(key(5), META, payload(5)), payload(5)))
    assert tier.contains([key(1), key(2), key(3), key(4)]) == 4  # present, until loaded and checked
    assert [tier.load(key(i)) for i in (1, 2, 3, 4)] == [None] * 4
    assert tier.stats.errors == {"checksum": 1, "fingerprint": 1, "dtype": 1, "header": 1, "key": 1}
    # A read-only instance does not repair (it never writes).
    reader = fast_tier(redis_url, publish=False)
    direct.set(reader.redis_key(key(6)), b"junk")
    assert reader.load(key(6)) is None and direct.exists(reader.redis_key(key(6))) == 1
    direct.close()


def test_a_killed_server_is_a_miss_then_the_client_reconnects(redis_factory: Factory,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    server = redis_factory()
    tier = fast_tier(server.url)
    assert tier.store(key(0), payload(0)) and tier.load(key(0)) == payload(0)
    server.kill()
    with caplog.at_level(logging.WARNING, logger="kvserve.kv_offload.redis_tier"):
        start = time.monotonic()
        assert tier.load(key(0)) is None  # connection refused: counted, backoff starts
        assert tier.contains([key(0), key(1)]) == 0
        assert not tier.store(key(1), payload(1))
        assert time.monotonic() - start < 0.5
    assert tier.stats.errors == {"connection": 1, "backoff": 2}
    assert not tier.available
    assert len(caplog.records) == 1 and "connection" in caplog.records[0].getMessage()
    time.sleep(0.25)  # past the first backoff (0.2 s): one try, refused again, backoff doubles
    assert tier.load(key(0)) is None
    assert tier.stats.errors["connection"] == 2
    restarted = RedisServer(server.binary, server.workdir, port=server.port).start()
    try:
        deadline = time.monotonic() + 3.0
        while not tier.store(key(2), payload(2)):
            assert time.monotonic() < deadline, "the tier did not reconnect"
            time.sleep(0.05)
        assert tier.available
        assert tier.load(key(2)) == payload(2)
        assert tier.load(key(0)) is None  # the killed server kept nothing (no persistence)
        assert tier.stats.errors["connection"] == 2  # nothing more failed once it was back
    finally:
        restarted.stop()


def test_a_paused_server_times_out_within_the_timeout(redis_factory: Factory) -> None:
    server = redis_factory()
    tier = fast_tier(server.url, timeout_s=0.2, backoff_initial_s=0.3)
    assert tier.store(key(0), payload(0))
    server.pause()
    try:
        start = time.monotonic()
        assert tier.load(key(0)) is None
        elapsed = time.monotonic() - start
        assert 0.15 < elapsed < 0.7
        start = time.monotonic()
        assert tier.contains([key(0)]) == 0 and not tier.store(key(1), payload(1))  # backing off: no wait
        assert time.monotonic() - start < 0.15  # under the 0.2 s timeout: no wait (a loaded host adds ms)
        assert tier.stats.errors == {"timeout": 1, "backoff": 2}
        time.sleep(0.35)
        start = time.monotonic()
        assert tier.contains([key(0)]) == 0  # a new connection: accepted by the kernel, never answered
        assert 0.15 < time.monotonic() - start < 0.7
        assert tier.stats.errors == {"timeout": 2, "backoff": 2}
    finally:
        server.resume()
    deadline = time.monotonic() + 3.0
    while tier.load(key(0)) != payload(0):  # after the backoff, answers again; no stale reply mixed in
        assert time.monotonic() < deadline, "the tier did not recover after SIGCONT"
        time.sleep(0.05)
    assert tier.contains([key(0), key(1)]) == 1
    assert tier.stats.errors["timeout"] == 2 and "checksum" not in tier.stats.errors


def test_a_full_server_refuses_stores(redis_factory: Factory) -> None:
    meta = BlockMeta("fp-big", "uint8", 16, (64, 1024))  # 64 KiB blocks
    server = redis_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    tier = fast_tier(server.url, meta)
    results = [tier.store(key(i), payload(i, meta)) for i in range(60)]  # ~3.8 MiB offered
    assert results[0] and not results[-1]
    stored = results.index(False)
    assert 5 <= stored < 40 and all(results[:stored])
    assert tier.stats.errors["full"] == 60 - stored and set(tier.stats.errors) == {"full"}
    assert tier.available  # a full server is no reason to back off
    assert tier.load(key(0)) == payload(0, meta)
    assert tier.contains([key(i) for i in range(60)]) == stored


def test_password_from_url_or_env_never_logged(redis_factory: Factory, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    server = redis_factory("--requirepass", "s3cret-pw")
    assert server.url == f"redis://:s3cret-pw@127.0.0.1:{server.port}/0"
    with caplog.at_level(logging.DEBUG, logger="kvserve.kv_offload"):
        with_url = fast_tier(server.url)
        assert with_url.store(key(0), payload(0))
        bare = f"redis://127.0.0.1:{server.port}/0"
        monkeypatch.setenv("KVSERVE_REDIS_PASSWORD", "s3cret-pw")
        assert fast_tier(bare).load(key(0)) == payload(0)
        monkeypatch.setenv("KVSERVE_REDIS_PASSWORD", "wrong-pw")
        wrong = fast_tier(bare)
        assert wrong.load(key(0)) is None
        assert wrong.stats.errors == {"auth": 1}
        monkeypatch.delenv("KVSERVE_REDIS_PASSWORD")
        anonymous = fast_tier(bare)
        assert anonymous.load(key(0)) is None and anonymous.stats.errors == {"auth": 1}
    assert caplog.records, "the auth failures are logged"
    assert "s3cret-pw" not in caplog.text and "wrong-pw" not in caplog.text
    assert "s3cret-pw" not in repr(with_url)
    assert with_url.url_masked == f"redis://:***@127.0.0.1:{server.port}/0"


def test_mask_url_and_url_schemes(tmp_path: Path) -> None:
    assert mask_url("redis://user:pw@h:6379/0") == "redis://user:***@h:6379/0"
    assert mask_url("rediss://:pw@h:6380/1") == "rediss://:***@h:6380/1"
    assert mask_url("redis://h:6379/0") == "redis://h:6379/0"
    sock = tmp_path / "r.sock"
    assert mask_url(f"unix://{sock}?db=0&password=pw") == f"unix://{sock}?db=0&password=***"
    tls = RedisTier("rediss://:pw@127.0.0.1:1/0", META)  # no connection is made here
    assert tls.client.connection_pool.connection_class is redis.SSLConnection
    assert RedisTier("redis://127.0.0.1:1/2", META).client.connection_pool.connection_kwargs["db"] == 2
    with pytest.raises(ValueError, match="scheme"):
        RedisTier("http://127.0.0.1:1/0", META)
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:1/0", META, timeout_s=0)
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:1/0", META, backoff_initial_s=2, backoff_max_s=1)


def test_backoff_grows_and_is_capped() -> None:
    tier = fast_tier("redis://127.0.0.1:1/0", backoff_initial_s=0.01, backoff_max_s=0.04)  # nothing listens
    for expected in (0.01, 0.02, 0.04, 0.04, 0.04):
        while not tier.available:
            time.sleep(0.002)
        before = time.monotonic()
        assert tier.load(key(0)) is None
        after = time.monotonic()
        assert after + expected - 1e-6 >= tier._retry_at >= before + expected - 1e-6
    assert tier.stats.errors["connection"] == 5
