"""The interface of one KV offload tier, its counters, and its measured load speed.

A tier holds whole KV blocks keyed by the block hash (``kvserve.core.block_hash``: the chain covers the
model fingerprint, the tenant salt and every earlier token, so equal keys mean equal K/V). Tiers never
raise for a fault of their store (a server down, a full disk, a damaged value): such a block is a miss, a
refused store, and a counter in ``stats.errors`` by kind.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

#: Error kinds a tier counts besides the ``CorruptBlockError`` kinds of ``format.py``.
#: ``size``: a payload of the wrong length was offered; ``too_big``: larger than the tier's capacity;
#: ``io``: a local read/write failed; ``off``: a call refused because the tier turned itself off;
#: ``connection`` / ``auth`` / ``timeout`` / ``full`` / ``response``: Redis refused the connection or the
#: credentials, timed out, is out of memory, answered with another error; ``backoff``: a call skipped while
#: waiting to reconnect.
TIER_ERROR_KINDS: tuple[str, ...] = ("size", "too_big", "io", "off", "connection", "auth", "timeout", "full",
                                     "response", "backoff")


#: Bytes per element of the KV dtypes a block may hold (torch's names).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1,
}


@dataclass(frozen=True)
class BlockMeta:
    """What every block of one engine looks like; a tier refuses values that differ.

    Attributes:
        fingerprint: the model fingerprint (weights, config, tokenizer, KV dtype).
        dtype: the KV element dtype, a key of ``DTYPE_ITEMSIZE`` (e.g. ``"bfloat16"``).
        block_size: tokens per block.
        shape: the payload's shape in elements, e.g. ``(num_layers, 2, block_size, num_kv_heads, head_dim)``.

    Raises:
        ValueError: an unknown dtype, a non-positive block size or shape entry, or an empty shape.
    """

    fingerprint: str
    dtype: str
    block_size: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; one of {', '.join(DTYPE_ITEMSIZE)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"shape must be non-empty with positive entries, got {self.shape}")

    @property
    def nbytes(self) -> int:
        """The payload size of one block in bytes: prod(shape) * itemsize(dtype)."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass
class TierStats:
    """Counters of one tier (monotonic; read them, don't write them).

    Attributes:
        queries: keys asked by ``contains`` (blocks; multiply by block_size for tokens).
        hits: keys found by ``contains`` in the leading run it returned (blocks).
        loads: ``load`` calls; ``load_misses`` of them returned None (absent, faulty or damaged).
        stores: blocks written by ``store``; ``already_present``: stores of a block the tier had already.
        evictions: blocks the tier dropped to make room (cpu, disk).
        bytes_stored / bytes_loaded: payload bytes written / returned.
        load_seconds: total wall time of ``load`` calls that returned a payload (s).
        errors: faults and refusals by kind (see ``TIER_ERROR_KINDS`` and ``format.CORRUPT_KINDS``).
    """

    queries: int = 0
    hits: int = 0
    loads: int = 0
    load_misses: int = 0
    stores: int = 0
    already_present: int = 0
    evictions: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)

    def count_error(self, kind: str, n: int = 1) -> None:
        """Add ``n`` to ``errors[kind]``."""
        self.errors[kind] = self.errors.get(kind, 0) + n


class LoadEstimator:
    """Measured load speed of one tier: ``seconds ≈ latency_s * calls + bytes / bytes_per_s``.

    Fed with every real load (``observe``), it keeps exponential moving averages (weight ``alpha`` for the
    newest sample, as the engine keeps its speeds) of the bytes and seconds per call and of their products,
    and fits the line by least squares. Blocks are one size, so the samples usually have one size: then the
    latency cannot be told apart from the transfer and is folded into the bandwidth (``latency_s`` = 0,
    ``bytes_per_s`` = mean bytes / mean seconds), which still predicts exactly a run of such blocks loaded one
    call each. Until the first sample the priors answer; the first sample replaces them.
    """

    def __init__(self, prior_bytes_per_s: float, prior_latency_s: float, alpha: float = 0.2) -> None:
        """Raises ValueError for a non-positive prior bandwidth, a negative prior latency or alpha outside (0, 1]."""
        if not prior_bytes_per_s > 0 or not prior_latency_s >= 0 or not 0 < alpha <= 1:
            raise ValueError("prior_bytes_per_s must be > 0, prior_latency_s >= 0 and alpha in (0, 1]")
        self.alpha = alpha
        self.samples = 0
        self._bytes_per_s = float(prior_bytes_per_s)
        self._latency_s = float(prior_latency_s)
        self._mx = self._my = self._mxx = self._mxy = 0.0
        self._lock = threading.Lock()

    def observe(self, num_bytes: int, seconds: float) -> None:
        """Record one load of ``num_bytes`` bytes that took ``seconds`` s (ignored unless both are > 0)."""
        if num_bytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        x, y = float(num_bytes), float(seconds)
        with self._lock:
            a = 1.0 if self.samples == 0 else self.alpha
            self._mx += a * (x - self._mx)
            self._my += a * (y - self._my)
            self._mxx += a * (x * x - self._mxx)
            self._mxy += a * (x * y - self._mxy)
            self.samples += 1
            var = self._mxx - self._mx * self._mx
            latency = 0.0
            if var > (0.05 * self._mx) ** 2:  # sizes vary enough (> 5 % std) to fit a line
                slope = (self._mxy - self._mx * self._my) / var
                if slope > 0:
                    latency = min(max(self._my - slope * self._mx, 0.0), 0.95 * self._my)
            self._latency_s = latency
            self._bytes_per_s = self._mx / max(self._my - latency, 1e-12)

    @property
    def bytes_per_s(self) -> float:
        """The transfer bandwidth (bytes/s)."""
        return self._bytes_per_s

    @property
    def latency_s(self) -> float:
        """The fixed cost of one load call (s)."""
        return self._latency_s

    def estimate_load_seconds(self, num_bytes: int, num_calls: int = 1) -> float:
        """Predicted seconds to load ``num_bytes`` bytes in ``num_calls`` calls (a run of blocks is one call
        per block)."""
        return max(num_calls, 0) * self._latency_s + max(num_bytes, 0) / self._bytes_per_s


@runtime_checkable
class KVTier(Protocol):
    """One tier of the KV offload cache. Implementations are thread-safe (the engine stores from a writer
    thread while it looks up and loads from its own)."""

    name: str
    stats: TierStats
    speed: LoadEstimator

    def contains(self, keys: Sequence[bytes]) -> int:
        """The number of leading ``keys`` present (the longest run of consecutive hits from ``keys[0]``, as
        admission walks a hash chain); 0 on any fault."""
        ...

    def load(self, key: bytes) -> bytes | None:
        """The validated payload of block ``key``, or None on a miss or any fault (never raises for one)."""
        ...

    def store(self, key: bytes, data: bytes) -> bool:
        """Store payload ``data`` (``meta.nbytes`` bytes) as block ``key``. True when the block is in the tier
        after the call (written now or already there); False when refused (wrong size, no room, tier off,
        read-only) or failed."""
        ...

    def estimate_load_seconds(self, num_bytes: int, num_calls: int = 1) -> float:
        """Predicted seconds to load ``num_bytes`` payload bytes in ``num_calls`` loads (measured speed)."""
        ...

    def close(self) -> None:
        """Release the tier's resources; later calls are misses / refused stores."""
        ...
