"""The host-memory tier: an LRU of block payloads (bytes) with a capacity in bytes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.kv_offload.tier import BlockMeta, LoadEstimator, TierStats

GIB = 1 << 30


class CPUTier:
    """Block payloads in host memory, least recently used evicted first.

    A ``load`` or a repeated ``store`` makes a block the most recent; ``contains`` does not (the engine loads
    what it found). Payloads are kept as given (trusted process memory: no header, no checksum).
    """

    name = "cpu"

    def __init__(self, capacity_bytes: int, meta: BlockMeta) -> None:
        """``capacity_bytes``: the most payload bytes held (>= 0; 0 holds nothing).

        Raises:
            ValueError: a negative capacity.
        """
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self.meta = meta
        self.stats = TierStats()
        self.speed = LoadEstimator(prior_bytes_per_s=8e9, prior_latency_s=2e-6)
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def from_gib(cls, gib: float, meta: BlockMeta) -> CPUTier:
        """A tier of ``gib`` GiB (2**30 bytes)."""
        return cls(int(gib * GIB), meta)

    @property
    def used_bytes(self) -> int:
        """Payload bytes held now."""
        return self._used

    def __len__(self) -> int:
        return len(self._blocks)

    def keys_lru(self) -> list[bytes]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._blocks)

    def contains(self, keys: Sequence[bytes]) -> int:
        """The number of leading ``keys`` held (see ``KVTier.contains``)."""
        with self._lock:
            n = 0
            if not self._closed:
                for key in keys:
                    if key not in self._blocks:
                        break
                    n += 1
            self.stats.queries += len(keys)
            self.stats.hits += n
            return n

    def load(self, key: bytes) -> bytes | None:
        """The payload of block ``key`` (made most recent), or None when absent."""
        start = time.perf_counter()
        with self._lock:
            self.stats.loads += 1
            data = None if self._closed else self._blocks.get(key)
            if data is None:
                self.stats.load_misses += 1
                return None
            self._blocks.move_to_end(key)
            seconds = time.perf_counter() - start
            self.stats.bytes_loaded += len(data)
            self.stats.load_seconds += seconds
        self.speed.observe(len(data), seconds)
        return data

    def store(self, key: bytes, data: bytes) -> bool:
        """Hold ``data`` as block ``key``, evicting the least recently used blocks to make room.

        Returns True when the block is held after the call; False for a payload that is not ``meta.nbytes``
        long (``errors["size"]``), larger than the capacity (``errors["too_big"]``), or a closed tier.
        """
        with self._lock:
            if self._closed:
                self.stats.count_error("off")
                return False
            if len(data) != self.meta.nbytes:
                self.stats.count_error("size")
                return False
            if key in self._blocks:
                self._blocks.move_to_end(key)
                self.stats.already_present += 1
                return True
            if len(data) > self.capacity_bytes:
                self.stats.count_error("too_big")
                return False
            while self._used + len(data) > self.capacity_bytes:
                _, old = self._blocks.popitem(last=False)
                self._used -= len(old)
                self.stats.evictions += 1
            self._blocks[key] = bytes(data)
            self._used += len(data)
            self.stats.stores += 1
            self.stats.bytes_stored += len(data)
            return True

    def estimate_load_seconds(self, num_bytes: int, num_calls: int = 1) -> float:
        """Predicted seconds to load ``num_bytes`` bytes in ``num_calls`` loads."""
        return self.speed.estimate_load_seconds(num_bytes, num_calls)

    def close(self) -> None:
        """Drop every block; later calls miss."""
        with self._lock:
            self._closed = True
            self._blocks.clear()
            self._used = 0
