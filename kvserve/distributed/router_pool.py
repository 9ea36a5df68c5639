"""The router's replicas and how it picks one for a request: cache-aware (SGLang's rule), least-loaded or
round-robin. Torch-free.

Load of a replica = the router's in-flight requests to it + its ``running`` + ``waiting`` sequences (from its
``/metrics``, scraped every health-check period). ``cache-aware`` picks, for a request whose prompt hashes to
blocks ``h``:

1. When the load is imbalanced over the healthy replicas, ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min``: the least loaded (reason ``balance``).
2. Else the replica whose index holds the longest prefix of ``h`` (ties: the less loaded), if that prefix is
   at least ``cache_threshold`` of ``h`` and the replica's KV usage is under ``kv_usage_threshold``
   (reason ``prefix``).
3. Else the replica with the smallest index (SGLang's smallest tree), ties to the less loaded, so that new
   prefixes spread evenly over the replicas' caches (reason ``least-loaded``).

The chosen replica's index then records ``h`` at once (before it answers), so that the next request with the
same prefix follows it even while the first is still in flight. A replica that turns unhealthy forgets its
index (its cache is gone if it died); it rejoins the rotation when ``/health`` answers 200 again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvserve.core.block_hash import BlockHash
from kvserve.disagg.proxy_backends import Backend
from kvserve.distributed.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

POLICIES = ("cache-aware", "round-robin", "least-loaded")


@dataclass(frozen=True)
class RoutingConfig:
    """How ``cache-aware`` weighs prefix affinity against load (see the module docstring).

    Attributes:
        policy: one of ``POLICIES``.
        cache_threshold: the fraction of a prompt's blocks (0..1) a replica must hold to win on affinity.
        balance_abs_threshold: load difference (sequences) above which the load counts as imbalanced ...
        balance_rel_threshold: ... when the most loaded also carries more than this times the least.
        kv_usage_threshold: a replica whose KV usage (0..1) is at least this never wins on affinity.
        max_index_blocks: the bound of each replica's index (block hashes).
    """

    policy: str = "cache-aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: float = 8.0
    balance_rel_threshold: float = 1.5
    kv_usage_threshold: float = 0.9
    max_index_blocks: int = 1 << 16

    def __post_init__(self) -> None:
        """Raises ValueError naming the field and its allowed range."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("cache_threshold", "kv_usage_threshold"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {v}")
        if not self.balance_abs_threshold >= 0:
            raise ValueError(f"balance_abs_threshold: must be >= 0, got {self.balance_abs_threshold}")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold: must be >= 1, got {self.balance_rel_threshold}")
        if self.max_index_blocks < 1:
            raise ValueError(f"max_index_blocks: must be >= 1, got {self.max_index_blocks}")


class RouterMetrics:
    """The router's own metrics (``kvserve_router_*``) on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvserve_router_requests", "Client requests routed, by endpoint (completions, "
                                "chat) and reason (prefix, balance, least-loaded, round-robin).",
                                ["endpoint", "reason"], registry=r)
        self.replica_requests = Counter("kvserve_router_replica_requests", "Requests sent to each replica "
                                        "(retries included).", ["url"], registry=r)
        self.retries = Counter("kvserve_router_retries", "Requests sent again to another replica after one "
                               "failed before the client got any token.", registry=r)
        self.failures = Counter("kvserve_router_failures", "Failures by kind: replica_<connect|timeout|http_5xx|"
                                "http_429|stream|bad_response>, stream_broken (after tokens were streamed), "
                                "unavailable (no replica left), client_disconnect.", ["kind"], registry=r)
        self.query_blocks = Counter("kvserve_router_prefix_query_blocks", "Prompt blocks looked up in the "
                                    "chosen replica's index.", registry=r)
        self.hit_blocks = Counter("kvserve_router_prefix_hit_blocks", "Prompt blocks the chosen replica's "
                                  "index held (the router's estimate of prefix cache hits).", registry=r)
        self.healthy = Gauge("kvserve_router_replica_healthy", "1 while a replica is healthy, else 0.", ["url"],
                             registry=r)
        self.inflight = Gauge("kvserve_router_replica_inflight", "The router's requests to each replica now.",
                              ["url"], registry=r)
        self.index_blocks = Gauge("kvserve_router_replica_index_blocks", "Block hashes in each replica's index.",
                                  ["url"], registry=r)

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)


class Route(NamedTuple):
    """A routing decision."""

    replica: Backend
    reason: str  # prefix | balance | least-loaded | round-robin
    matched_blocks: int  # leading prompt blocks the replica's index held


class ReplicaPool:
    """The replicas (``Backend`` with role ``replica``), their indexes and the routing between them."""

    def __init__(self, urls: Iterable[str], config: RoutingConfig, metrics: RouterMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._backends = [Backend(u, "replica") for u in urls]
        self.indexes = {b.url: PrefixIndex(config.max_index_blocks) for b in self._backends}
        self._turn = 0
        for b in self._backends:
            metrics.healthy.labels(b.url).set(1)
            metrics.inflight.labels(b.url).set_function(self._inflight_of(b))
            metrics.index_blocks.labels(b.url).set_function(self._index_size_of(b.url))

    @staticmethod
    def _inflight_of(b: Backend) -> Callable[[], float]:
        return lambda: b.inflight

    def _index_size_of(self, url: str) -> Callable[[], float]:
        return lambda: len(self.indexes[url])

    @property
    def backends(self) -> Sequence[Backend]:
        return self._backends

    @property
    def wants_load(self) -> bool:
        return True  # every policy but round-robin reads it, and it costs one GET per period

    @property
    def any_healthy(self) -> bool:
        """Whether one replica is healthy."""
        return any(b.healthy for b in self._backends)

    def set_health(self, backend: Backend, healthy: bool, why: str = "") -> None:
        """Mark a replica (un)healthy; logs a change; an unhealthy one forgets its index."""
        if backend.healthy != healthy:
            if healthy:
                logger.info("replica %s is healthy again", backend.url)
            else:
                logger.warning("replica %s is unhealthy (%s); out of rotation until /health answers 200",
                               backend.url, why)
                self.indexes[backend.url].clear()
        backend.healthy = healthy
        self.metrics.healthy.labels(backend.url).set(1 if healthy else 0)

    def pick(self, hashes: Sequence[BlockHash], exclude: Iterable[Backend] = ()) -> Route | None:
        """The replica for a request whose prompt hashes to ``hashes`` (None: no healthy one outside
        ``exclude``); its index records ``hashes``."""
        skip = set(exclude)
        n = len(self._backends)
        k = self._turn % n
        self._turn += 1
        # in turn from k, so that min() (which keeps the first of equals) breaks ties round-robin
        order = [b for b in self._backends[k:] + self._backends[:k] if b.healthy and b not in skip]
        if not order:
            return None
        route = self._choose(order, hashes)
        self.indexes[route.replica.url].insert(hashes)
        self.metrics.query_blocks.inc(len(hashes))
        self.metrics.hit_blocks.inc(route.matched_blocks)
        self.metrics.replica_requests.labels(route.replica.url).inc()
        return route

    def _choose(self, order: list[Backend], hashes: Sequence[BlockHash]) -> Route:
        cfg = self.config
        if cfg.policy == "round-robin":
            b = order[0]
            return Route(b, "round-robin", self.indexes[b.url].match(hashes))
        if cfg.policy == "least-loaded":
            b = min(order, key=lambda r: r.load)
            return Route(b, "least-loaded", self.indexes[b.url].match(hashes))
        matched = {b.url: self.indexes[b.url].match(hashes) for b in order}
        lo = min(b.load for b in order)
        hi = max(b.load for b in order)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            b = min(order, key=lambda r: r.load)
            return Route(b, "balance", matched[b.url])
        if hashes:
            eligible = [b for b in order if b.kv_usage < cfg.kv_usage_threshold]
            best = max(eligible, key=lambda r: (matched[r.url], -r.load), default=None)
            if best is not None and matched[best.url] > 0 and \
                    matched[best.url] >= cfg.cache_threshold * len(hashes):
                return Route(best, "prefix", matched[best.url])
        # a new prefix: the replica caching least (SGLang's "smallest tree"), so that the tenants' prefixes
        # spread evenly over the caches; load decides between equals (step 1 caught real imbalance)
        b = min(order, key=lambda r: (len(self.indexes[r.url]), r.load))
        return Route(b, "least-loaded", matched[b.url])
