"""The Redis tier: blocks in a Redis-compatible server shared by every kvserve instance that points at it.

Values are blocks in the ``format.py`` layout under ``<prefix><hex key>``. A block is immutable, so a store
is ``SET ... NX`` ("publish once", with an optional TTL). The server must be trusted and authenticated:
anyone who can write to it can poison the cached KV of every instance reading it (the header and checksum
catch damage and mix-ups, not a forged block).

Faults never reach the caller: a refused connection, a timeout (``timeout_s`` per call), an out-of-memory
server, or a value failing its header or checksum is a miss / a refused store, counted in
``stats.errors`` by kind (``connection``, ``auth``, ``timeout``, ``full``, ``response``, or a
``CorruptBlockError`` kind). After a connection error or a timeout the tier backs off (exponential, capped)
and answers every call as a miss (``errors["backoff"]``) until the wait is over; the next call then
reconnects (redis-py's pool opens a new connection). The password, from the URL or an environment variable,
is never logged: logs show the URL with the password masked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.kv_offload.format import CorruptBlockError, decode_block, encode_block, make_header
from kvserve.kv_offload.tier import BlockMeta, LoadEstimator, TierStats

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "kvserve:"
DEFAULT_TIMEOUT_S = 0.2
PASSWORD_ENV = "KVSERVE_REDIS_PASSWORD"
URL_SCHEMES = ("redis", "rediss", "unix")

T = TypeVar("T")


def mask_url(url: str) -> str:
    """``url`` with its password (userinfo or a ``password=`` query value) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")
    # Not urlunsplit: it turns "unix:///path" into "unix:/path".
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


class _Unavailable(Exception):
    """Raised inside the tier while it backs off; never leaves the tier."""


class RedisTier:
    """Blocks in Redis under ``prefix`` (see the module docstring for faults and backoff)."""

    name = "redis"

    def __init__(self, url: str, meta: BlockMeta, *, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = DEFAULT_TIMEOUT_S, ttl_s: float | None = None, publish: bool = True,
                 password_env: str = PASSWORD_ENV, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 30.0, repair: bool = True) -> None:
        """A client of the server at ``url`` (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS,
        ``unix://path``). It connects at the first call, not here.

        Args:
            meta: what this engine's blocks look like; values that differ are misses.
            prefix: prepended to every key (one per deployment, so deployments sharing a server never mix).
            timeout_s: socket timeout of each call, connect included (s).
            ttl_s: expiry of stored blocks (s, rounded up to ms); None keeps them until the server evicts them.
            publish: False makes the tier read-only (``store`` refuses without a call, no repairs).
            password_env: the environment variable read for the password when the URL has none.
            backoff_initial_s, backoff_max_s: the wait after the first connection fault, doubled per
                further consecutive fault up to the cap (s).
            repair: delete a value that fails validation (other than a newer format version), so a good copy
                can be published again; only with ``publish``.

        Raises:
            ValueError: an unsupported scheme, a non-positive timeout, TTL or backoff.
        """
        scheme = urlsplit(url).scheme
        if scheme not in URL_SCHEMES:
            raise ValueError(f"redis URL scheme must be one of {', '.join(URL_SCHEMES)}, got {scheme!r}")
        if not timeout_s > 0 or (ttl_s is not None and not ttl_s > 0):
            raise ValueError("timeout_s and ttl_s must be > 0")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError("backoff must satisfy 0 < backoff_initial_s <= backoff_max_s")
        self.meta = meta
        self.prefix = prefix
        self.timeout_s = float(timeout_s)
        self.ttl_ms = None if ttl_s is None else max(1, int(-(-ttl_s * 1000 // 1)))
        self.publish = publish
        self.repair = repair and publish
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self.url_masked = mask_url(url)
        self.stats = TierStats()
        self.speed = LoadEstimator(prior_bytes_per_s=5e8, prior_latency_s=5e-4)
        self._lock = threading.Lock()
        self._failures = 0  # consecutive connection faults
        self._retry_at = 0.0  # time.monotonic() before which calls are skipped
        self._closed = False
        kwargs: dict[str, Any] = {}
        if urlsplit(url).password is None and not any(k.lower() == "password" for k, _ in
                                                      parse_qsl(urlsplit(url).query)):
            password = os.environ.get(password_env)
            if password:
                kwargs["password"] = password
        # No retries inside redis-py: a fault must cost at most one timeout, then the tier's own backoff.
        self._client = redis.Redis.from_url(url, socket_timeout=self.timeout_s,
                                            socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0),
                                            health_check_interval=0, **kwargs)

    def __repr__(self) -> str:
        return f"RedisTier({self.url_masked!r}, prefix={self.prefix!r})"

    @property
    def client(self) -> redis.Redis:
        """The redis-py client (for tests and tools)."""
        return self._client

    @property
    def available(self) -> bool:
        """False while backing off after a connection fault."""
        return time.monotonic() >= self._retry_at

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of block ``key``: prefix + hex key."""
        return self.prefix.encode() + bytes(key).hex().encode()

    def _call(self, fn: Callable[[], T]) -> T:
        """Run one round trip; translate faults into counters (raising ``_Unavailable``) and backoff."""
        if self._closed:
            with self._lock:
                self.stats.count_error("off")
            raise _Unavailable
        if time.monotonic() < self._retry_at:
            with self._lock:
                self.stats.count_error("backoff")
            raise _Unavailable
        try:
            result = fn()
        except redis.OutOfMemoryError:
            self._count("full")
            raise _Unavailable from None
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError) as e:
            self._fault("auth", e)
        except redis.TimeoutError as e:
            self._fault("timeout", e)
        except (redis.ConnectionError, OSError) as e:
            self._fault("connection", e)
        except redis.ResponseError as e:
            self._count("response")
            logger.debug("kv offload redis %s: %s", self.url_masked, e)
            raise _Unavailable from None
        except redis.RedisError as e:  # protocol errors and the like: a connection fault
            self._fault("connection", e)
        if self._failures:
            with self._lock:
                self._failures = 0
            logger.info("kv offload redis tier %s reachable again", self.url_masked)
        return result

    def _count(self, kind: str) -> None:
        with self._lock:
            self.stats.count_error(kind)

    def _fault(self, kind: str, error: Exception) -> Any:
        with self._lock:
            self.stats.count_error(kind)
            self._failures += 1
            wait = min(self.backoff_initial_s * 2 ** (self._failures - 1), self.backoff_max_s)
            self._retry_at = time.monotonic() + wait
            first = self._failures == 1
        (logger.warning if first else logger.debug)(
            "kv offload redis tier %s: %s (%s); misses for %.2f s, then reconnecting",
            self.url_masked, kind, error, wait)
        raise _Unavailable from None

    def contains(self, keys: Sequence[bytes]) -> int:
        """The number of leading ``keys`` present (one pipeline of EXISTS); 0 on any fault."""
        n = 0
        if keys:
            def run() -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.exists(self.redis_key(key))
                return pipe.execute()
            try:
                for present in self._call(run):
                    if not present:
                        break
                    n += 1
            except _Unavailable:
                n = 0
        with self._lock:
            self.stats.queries += len(keys)
            self.stats.hits += n
        return n

    def load(self, key: bytes) -> bytes | None:
        """The validated payload of block ``key``, or None when absent, on a fault, or when the value fails
        validation (counted by ``CorruptBlockError`` kind; removed when ``repair``)."""
        start = time.perf_counter()
        rkey = self.redis_key(key)
        with self._lock:
            self.stats.loads += 1
        try:
            data = self._call(lambda: self._client.get(rkey))
        except _Unavailable:
            data = None
        payload = None
        if data is not None and not isinstance(data, bytes):  # decode_responses is off: always bytes
            data = None
        if data is not None:
            try:
                payload = decode_block(data, self.meta, key)
            except CorruptBlockError as e:
                self._count(e.kind)
                logger.debug("kv offload redis %s: value of %r refused: %s", self.url_masked, rkey, e)
                if self.repair and e.kind != "version":
                    with contextlib.suppress(_Unavailable):
                        self._call(lambda: self._client.delete(rkey))
        seconds = time.perf_counter() - start
        with self._lock:
            if payload is None:
                self.stats.load_misses += 1
                return None
            self.stats.bytes_loaded += len(payload)
            self.stats.load_seconds += seconds
        self.speed.observe(len(payload), seconds)
        return payload

    def store(self, key: bytes, data: bytes) -> bool:
        """Publish ``data`` as block ``key`` once (``SET NX``, TTL if set).

        Returns True when the block is on the server after the call (written now, or there already:
        ``already_present``); False when read-only, for a payload that is not ``meta.nbytes`` long
        (``errors["size"]``), or on a fault (counted by kind; ``full`` for an out-of-memory server).
        """
        if not self.publish:
            return False
        if len(data) != self.meta.nbytes:
            self._count("size")
            return False
        blob = encode_block(make_header(key, self.meta, data), data)
        rkey = self.redis_key(key)
        try:
            written = self._call(lambda: self._client.set(rkey, blob, nx=True, px=self.ttl_ms))
        except _Unavailable:
            return False
        with self._lock:
            if written:
                self.stats.stores += 1
                self.stats.bytes_stored += len(data)
            else:
                self.stats.already_present += 1
        return True

    def estimate_load_seconds(self, num_bytes: int, num_calls: int = 1) -> float:
        """Predicted seconds to load ``num_bytes`` bytes in ``num_calls`` loads (GET + validation)."""
        return self.speed.estimate_load_seconds(num_bytes, num_calls)

    def close(self) -> None:
        """Close the connections; later calls are misses / refused stores (``errors["off"]``)."""
        self._closed = True
        with contextlib.suppress(redis.RedisError, OSError):
            self._client.close()
