"""The proxy's backends: health, load (scraped from each backend's ``/metrics``), picking one, and the proxy's
own Prometheus counters. Torch-free. ``kvserve router`` (kvserve/distributed/router.py) shares ``Backend``,
the scraping and the :class:`Pool` protocol with its own replica pool.

A backend is healthy until a request to it or a scrape of it fails with a connection error (or its
``/health`` answers other than 200); it is then skipped until a ``/health`` scrape answers 200 again.
``least-loaded`` picks the healthy backend with the smallest ``in-flight (this proxy's) + running + waiting``
(the last two from ``kvserve:num_requests_running`` / ``kvserve:num_requests_waiting``, or their ``vllm:``
twins), ties in turn; ``round-robin`` picks the healthy backends in turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

_RUNNING = {"kvserve:num_requests_running", "vllm:num_requests_running"}
_WAITING = {"kvserve:num_requests_waiting", "vllm:num_requests_waiting"}
_KV_USAGE = {"kvserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}


class ProxyMetrics:
    """The proxy's own counters, on a registry of their own (``render`` gives the Prometheus text)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvserve_proxy_requests", "Client requests, by endpoint (completions, chat) and "
                                "path (split: prefill then decode; passthrough: max_tokens 1, to a prefill "
                                "instance as is).", ["endpoint", "path"], registry=r)
        self.prefill_retries = Counter("kvserve_proxy_prefill_retries", "Prefill requests sent again to another "
                                       "prefill instance after one failed.", registry=r)
        self.fallback_recompute = Counter("kvserve_proxy_fallback_recompute", "Choices sent whole to a decode "
                                          "instance (which recomputes the prompt) because no prefill instance "
                                          "answered.", registry=r)
        self.failures = Counter("kvserve_proxy_failures", "Failures by kind: <role>_<connect|timeout|http_5xx|"
                                "http_4xx|bad_response|stream|unavailable>, client_disconnect, invalid_request.",
                                ["kind"], registry=r)
        self.healthy = Gauge("kvserve_proxy_backend_healthy", "1 while a backend is healthy, else 0.",
                             ["role", "url"], registry=r)

    def render(self) -> bytes:
        """The counters in Prometheus' text format."""
        return generate_latest(self.registry)


@dataclass(eq=False)
class Backend:
    """One prefill or decode instance.

    Attributes:
        url: its base URL (``http://host:port``, no trailing slash).
        role: ``prefill`` | ``decode``.
        healthy: see the module docstring.
        inflight: this proxy's requests to it now.
        running, waiting: its scheduler's queues at the last scrape (sequences).
        kv_usage: the fraction of its KV cache blocks in use at the last scrape (0..1).
    """

    url: str
    role: str
    healthy: bool = True
    inflight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0

    @property
    def load(self) -> float:
        """In-flight + running + waiting (sequences)."""
        return self.inflight + self.running + self.waiting


class Pool(Protocol):
    """What the scraping and :func:`kvserve.disagg.proxy_http.upstream` need of a pool of backends."""

    @property
    def backends(self) -> Sequence[Backend]: ...

    @property
    def wants_load(self) -> bool:
        """Whether a scrape reads ``/metrics`` too (routing by load)."""
        ...

    def set_health(self, backend: Backend, healthy: bool, why: str = "") -> None: ...


@dataclass
class BackendPool:
    """The backends of one role and the routing between them."""

    backends: list[Backend]
    routing: str
    metrics: ProxyMetrics
    _turn: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        for b in self.backends:
            self.metrics.healthy.labels(b.role, b.url).set(1 if b.healthy else 0)

    def pick(self, exclude: Iterable[Backend] = ()) -> Backend | None:
        """The backend for the next request (None: no healthy one outside ``exclude``)."""
        skip = set(exclude)
        if not self.backends:
            return None
        k = self._turn % len(self.backends)
        self._turn += 1
        order = [b for b in self.backends[k:] + self.backends[:k] if b.healthy and b not in skip]
        if not order:
            return None
        if self.routing == "round-robin":
            return order[0]
        return min(order, key=lambda b: b.load)  # min keeps the first of equals: ties go in turn

    def set_health(self, backend: Backend, healthy: bool, why: str = "") -> None:
        """Mark a backend (un)healthy; logs a change."""
        if backend.healthy != healthy:
            if healthy:
                logger.info("%s instance %s is healthy again", backend.role, backend.url)
            else:
                logger.warning("%s instance %s is unhealthy (%s); skipped until /health answers",
                               backend.role, backend.url, why)
        backend.healthy = healthy
        self.metrics.healthy.labels(backend.role, backend.url).set(1 if healthy else 0)

    @property
    def any_healthy(self) -> bool:
        """Whether one backend of the pool is healthy."""
        return any(b.healthy for b in self.backends)

    @property
    def wants_load(self) -> bool:
        """Least-loaded routing reads each backend's ``/metrics``."""
        return self.routing == "least-loaded"


class EngineLoad(NamedTuple):
    """A backend's load as its ``/metrics`` tells it."""

    running: float  # sequences running, summed over labels
    waiting: float  # sequences waiting
    kv_usage: float  # fraction of KV cache blocks in use (0..1), the largest over labels


def parse_load(text: str) -> EngineLoad:
    """The load in a backend's Prometheus text.

    Raises:
        ValueError: the text is not Prometheus' exposition format.
    """
    running = waiting = kv_usage = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _RUNNING:
                running += s.value
            elif s.name in _WAITING:
                waiting += s.value
            elif s.name in _KV_USAGE:
                kv_usage = max(kv_usage, s.value)
    return EngineLoad(running, waiting, kv_usage)


async def scrape(session: aiohttp.ClientSession, pool: Pool, backend: Backend, want_load: bool,
                 timeout_s: float) -> None:
    """Probe one backend: ``/health`` (200: healthy; a connection error or another status: unhealthy), then,
    when healthy and ``want_load``, ``/metrics`` for its load. A timeout leaves its state as it was."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(backend.url + "/health", timeout=timeout) as r:
            await r.read()
            pool.set_health(backend, r.status == 200, f"/health answered {r.status}")
        if not backend.healthy or not want_load:
            return
        async with session.get(backend.url + "/metrics", timeout=timeout) as r:
            text = await r.text()
            if r.status != 200:
                return
        backend.running, backend.waiting, backend.kv_usage = parse_load(text)
    except TimeoutError:
        return
    except aiohttp.ClientError as e:
        pool.set_health(backend, False, f"{type(e).__name__}: {e}")
    except (ValueError, UnicodeDecodeError) as e:
        logger.warning("%s instance %s: unreadable /metrics (%s)", backend.role, backend.url, e)


async def scrape_all(session: aiohttp.ClientSession, pools: Iterable[Pool], timeout_s: float) -> None:
    """One scrape of every backend of ``pools``, concurrently."""
    await asyncio.gather(*(scrape(session, pool, b, pool.wants_load, timeout_s)
                           for pool in pools for b in pool.backends))


async def scrape_forever(session: aiohttp.ClientSession, pools: Sequence[Pool], interval_s: float,
                         timeout_s: float | None = None) -> None:
    """Scrape every ``interval_s`` seconds until cancelled; one probe may take ``timeout_s`` (default
    ``max(2, 4 * interval_s)``) before it is left as it was."""
    timeout_s = timeout_s if timeout_s is not None else max(2.0, 4 * interval_s)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await scrape_all(session, pools, timeout_s)
        except Exception:  # noqa: BLE001 - the loop must outlive any one bad answer
            logger.exception("scraping the backends failed")
