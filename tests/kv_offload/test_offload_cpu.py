"""The host-memory tier: exact LRU order and capacity, counters, and the load speed estimate."""

from __future__ import annotations

import threading

import pytest
from offload_helpers import META, key, payload

from kvserve.kv_offload.cpu import CPUTier
from kvserve.kv_offload.tier import KVTier, LoadEstimator

N = META.nbytes  # 512


def test_lru_order_and_exact_capacity() -> None:
    tier = CPUTier(3 * N, META)
    assert isinstance(tier, KVTier)
    a, b, c, d = (key(i) for i in range(4))
    for i, k in enumerate((a, b, c)):
        assert tier.store(k, payload(i))
    assert tier.used_bytes == 3 * N and len(tier) == 3 and tier.stats.evictions == 0
    assert tier.keys_lru() == [a, b, c]
    assert tier.load(a) == payload(0)  # a becomes the most recent
    assert tier.keys_lru() == [b, c, a]
    assert tier.store(d, payload(3))  # full: b, the least recently used, goes
    assert tier.keys_lru() == [c, a, d]
    assert tier.used_bytes == 3 * N and tier.stats.evictions == 1
    assert tier.load(b) is None
    assert tier.store(c, payload(2))  # already there: made most recent, nothing written
    assert tier.keys_lru() == [a, d, c]
    assert (tier.stats.stores, tier.stats.already_present) == (4, 1)
    assert tier.store(key(4), payload(4)) and tier.keys_lru() == [d, c, key(4)]
    assert tier.stats.evictions == 2
    assert tier.stats.bytes_stored == 5 * N
    assert tier.stats.bytes_loaded == N
    assert (tier.stats.loads, tier.stats.load_misses) == (2, 1)


def test_contains_counts_the_leading_run() -> None:
    tier = CPUTier(10 * N, META)
    for i in (0, 1, 3):
        tier.store(key(i), payload(i))
    assert tier.contains([key(0), key(1), key(2), key(3)]) == 2
    assert tier.contains([key(2), key(3)]) == 0
    assert tier.contains([key(3)]) == 1
    assert tier.contains([]) == 0
    assert (tier.stats.queries, tier.stats.hits) == (7, 3)
    assert tier.keys_lru() == [key(0), key(1), key(3)]  # contains does not reorder


def test_refusals_are_counted() -> None:
    tier = CPUTier(N, META)
    assert not tier.store(key(0), payload(0)[:-1])
    assert not tier.store(key(0), payload(0) + b"\x00")
    assert tier.stats.errors == {"size": 2}
    assert not CPUTier(N - 1, META).store(key(0), payload(0))
    small = CPUTier(N - 1, META)
    small.store(key(0), payload(0))
    assert small.stats.errors == {"too_big": 1} and len(small) == 0
    assert not CPUTier(0, META).store(key(0), payload(0))
    with pytest.raises(ValueError):
        CPUTier(-1, META)
    assert tier.store(key(0), payload(0))
    tier.close()
    assert tier.load(key(0)) is None and tier.contains([key(0)]) == 0
    assert not tier.store(key(1), payload(1))
    assert tier.stats.errors == {"size": 2, "off": 1} and tier.used_bytes == 0


def test_from_gib_and_concurrent_use() -> None:
    tier = CPUTier.from_gib(64 * N / 2**30, META)
    assert tier.capacity_bytes == 64 * N

    def writer(base: int) -> None:
        for i in range(base, base + 200):
            assert tier.store(key(i), payload(i % 7))
            tier.load(key(i - 1))

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tier) == 64 and tier.used_bytes == 64 * N
    assert tier.stats.stores == 400 and tier.stats.evictions == 400 - 64


def test_load_speed_is_measured_from_real_loads() -> None:
    tier = CPUTier(8 * N, META)
    prior = tier.estimate_load_seconds(N)
    assert prior == pytest.approx(2e-6 + N / 8e9)
    tier.store(key(0), payload(0))
    for _ in range(5):
        tier.load(key(0))
    assert tier.speed.samples == 5
    assert tier.stats.load_seconds > 0
    # One block size: the fit folds the latency into the bandwidth; a run of n blocks costs n loads.
    assert tier.speed.latency_s == 0
    assert tier.estimate_load_seconds(3 * N, 3) == pytest.approx(3 * tier.estimate_load_seconds(N))


def test_load_estimator_fits_latency_and_bandwidth() -> None:
    est = LoadEstimator(prior_bytes_per_s=1e9, prior_latency_s=1e-3)
    assert est.estimate_load_seconds(10**6, 2) == pytest.approx(2e-3 + 1e-3)
    # Samples of t = 0.5 ms + bytes / 2 GB/s at two sizes.
    for i in range(40):
        n = 10**5 if i % 2 else 10**6
        est.observe(n, 5e-4 + n / 2e9)
    assert est.latency_s == pytest.approx(5e-4, rel=1e-6)
    assert est.bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert est.estimate_load_seconds(4 * 10**6, 4) == pytest.approx(4 * 5e-4 + 4 * 10**6 / 2e9, rel=1e-6)
    # One size only: the first sample replaces the priors, later ones move the EMA by alpha = 0.2.
    one = LoadEstimator(prior_bytes_per_s=1e9, prior_latency_s=1e-3)
    one.observe(1000, 1e-3)
    assert (one.latency_s, one.bytes_per_s) == (0.0, pytest.approx(1e6))
    one.observe(1000, 2e-3)
    assert one.estimate_load_seconds(1000) == pytest.approx(0.8 * 1e-3 + 0.2 * 2e-3)
    one.observe(0, 1.0)  # ignored
    one.observe(1000, 0.0)  # ignored
    assert one.samples == 2
    with pytest.raises(ValueError):
        LoadEstimator(prior_bytes_per_s=0, prior_latency_s=0)
