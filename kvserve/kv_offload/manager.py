"""The offload manager: what the scheduler asks at admission, and where evicted and new blocks go.

    device pool ──evicted full block──▶ writer thread ──▶ cpu (LRU) and disk (write-through, survives restarts)
                └──block committed (full)──▶ writer thread ──▶ redis (published once, for other instances)

    admission: device hits ─▶ lookup(): cpu ─▶ disk ─▶ redis, the longest run of consecutive hits ─▶
               fetch or recompute (per tier segment, by measured speeds) ─▶ payloads ─▶ fresh device blocks

A lookup whose run is all in host memory is loaded at once; anything slower is fetched by a background
thread while the request waits (it is passed over at admission, other requests go ahead), and admitted on
the first step after its payloads are in. A block that fails to load (a fault, a damaged value) ends the
run there: its tokens and the rest are recomputed. Stores never block a step: a full queue drops the
block and counts it. An evicted block still waiting for the writer is found all the same: lookups see it
as held by the first local tier (``_pending``), so a request admitted a step after the eviction hits it
whatever the writer's pace. Torch-free (payloads are bytes; the runner turns them into tensors).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import accumulate

from kvserve.core.block_hash import BlockHash
from kvserve.core.request import Request
from kvserve.kv_offload.tier import KVTier

logger = logging.getLogger(__name__)


@dataclass
class OffloadStats:
    """Manager counters (totals since start; the tiers keep their own in ``tier.stats``).

    Attributes:
        lookups: admission lookups that asked the tiers (requests; a request passed over while its fetch
            runs asks once).
        hit_tokens: tokens loaded from a tier into device blocks, by tier name.
        recomputed_tokens: tokens found in a tier but recomputed because fetching was predicted slower.
        failed_loads: blocks a tier listed but could not deliver (the run ended there).
        stores_dropped: blocks not stored because the writer queue was full.
        stores_queued: blocks handed to the writer.
    """

    lookups: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    failed_loads: int = 0
    stores_dropped: int = 0
    stores_queued: int = 0


@dataclass(frozen=True)
class TierSnapshot:
    """One tier's totals for metrics: tokens queried / hit (``contains``), bytes, errors by kind."""

    queries_tokens: int
    hits_tokens: int
    bytes_stored: int
    bytes_loaded: int
    errors: dict[str, int]


@dataclass(frozen=True)
class OffloadSnapshot:
    """What the metrics read after a step (totals, except ``load_seconds``: the fetches since last time)."""

    tiers: dict[str, TierSnapshot]
    loaded_tokens: dict[str, int]
    stores_dropped: int
    load_seconds: list[tuple[str, float]]


@dataclass
class _Fetch:
    first_block: int
    future: Future[list[bytes]] | None
    payloads: list[bytes] | None = None


class OffloadManager:
    """Looks up, fetches and stores KV blocks in the configured tiers.

    Args:
        tiers: lookup order (``config.build_tiers``: cpu, disk, redis).
        block_size: tokens per block.
        block_nbytes: payload bytes of one block.
        prefill_tokens_per_s: returns the engine's measured prefill speed (tokens/s; 0: not measured, then
            fetching is assumed to win).
        publish: publish committed blocks to the remote (redis) tiers.
        queue_size: most blocks waiting for the writer (more are dropped and counted).
    """

    def __init__(self, tiers: Sequence[KVTier], block_size: int, block_nbytes: int,
                 prefill_tokens_per_s: Callable[[], float] | None = None,
                 publish: bool = True, queue_size: int = 1024) -> None:
        self.tiers = list(tiers)
        self.local = [t for t in self.tiers if t.name != "redis"]
        self.remote = [t for t in self.tiers if t.name == "redis"]
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self._prefill_speed = prefill_tokens_per_s or (lambda: 0.0)
        self.publish = publish and bool(self.remote)
        self.stats = OffloadStats()
        self._fetches: dict[str, _Fetch] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-offload-fetch")
        self._queue: queue.Queue[tuple[BlockHash, bytes, bool] | None] = queue.Queue(maxsize=queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()
        self._closed = False
        self._load_seconds: list[tuple[str, float]] = []  # (tier, seconds) per run loaded from one tier
        self._lock = threading.Lock()
        # Evicted blocks queued for the local tiers and not yet stored: hash -> payload (under _lock).
        self._pending: dict[bytes, bytes] = {}
        self._first_local = self.local[0] if self.local else None

    # ---- admission (scheduler thread) ------------------------------------------------------------
    def lookup(self, request: Request, first_block: int, max_blocks: int) -> list[bytes] | None:
        """Payloads of the blocks ``first_block, first_block + 1, ...`` of ``request``'s hash chain that the
        tiers hold (at most ``max_blocks``), ready to load; ``[]`` when none (or not worth fetching); None
        while a background fetch for it runs (pass the request over this step).

        ``request.block_hashes`` must hold the chain (``BlockManager.request_block_hashes``). The payloads
        stay with the manager until ``release`` (call it once the request is admitted): a request that could
        not be admitted this step gets the same payloads next time without asking the tiers again.
        """
        rid = request.request_id
        fetch = self._fetches.get(rid)
        if fetch is not None:
            if fetch.future is not None and not fetch.future.done():
                return None
            if fetch.future is not None:
                fetch.payloads, fetch.future = fetch.future.result(), None
            if fetch.first_block == first_block:
                return (fetch.payloads or [])[:max_blocks]
            del self._fetches[rid]  # the device cache changed meanwhile: look again
        if max_blocks <= 0 or not self.tiers:
            return []
        keys = [bytes(h) for h in request.block_hashes[first_block:first_block + max_blocks]]
        self.stats.lookups += 1
        segments: list[tuple[KVTier, int]] = []
        pos = 0
        for tier in self.tiers:
            if pos >= len(keys):
                break
            n = self._contains(tier, keys[pos:])
            if n > 0:
                segments.append((tier, n))
                pos += n
        # Fetch or recompute, segment by segment (a run must stay consecutive: stop at the first loser).
        speed = self._prefill_speed()
        chosen: list[tuple[KVTier, int]] = []
        for i, (tier, n) in enumerate(segments):
            load_s = tier.estimate_load_seconds(n * self.block_nbytes, n)
            if speed > 0 and load_s >= n * self.block_size / speed:
                self.stats.recomputed_tokens += sum(m for _, m in segments[i:]) * self.block_size
                break
            chosen.append((tier, n))
        if not chosen:
            return []
        starts = accumulate((n for _, n in chosen), initial=0)
        plan = [(tier, keys[start:start + n]) for (tier, n), start in zip(chosen, starts, strict=False)]
        if all(tier.name == "cpu" for tier, _ in plan):
            payloads = self._load(plan)
            self._fetches[rid] = _Fetch(first_block, None, payloads)
            return payloads
        self._fetches[rid] = _Fetch(first_block, self._pool.submit(self._load, plan))
        return None

    def _contains(self, tier: KVTier, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, ``tier`` holds; for the first local tier, counting the
        evicted blocks still queued for it (``tier.contains`` is asked once per run of stored blocks)."""
        if tier is not self._first_local:
            return tier.contains(keys)
        n = 0
        while n < len(keys):
            with self._lock:
                while n < len(keys) and keys[n] in self._pending:
                    n += 1
            if n >= len(keys):
                break
            m = tier.contains(keys[n:])
            if m == 0:
                break
            n += m
        return n

    def _load(self, plan: list[tuple[KVTier, list[bytes]]]) -> list[bytes]:
        """Load the planned blocks in order; stop at the first that fails. A block of the first local tier
        still queued for the writer is taken from the queue's copy (the writer removes it only after storing
        it, so it is always in one place or the other, unless the tier has evicted it since)."""
        out: list[bytes] = []
        for tier, keys in plan:
            t0 = time.perf_counter()
            for key in keys:
                data = None
                if tier is self._first_local:
                    with self._lock:
                        data = self._pending.get(key)
                if data is None:
                    data = tier.load(key)
                if data is None:
                    with self._lock:
                        self.stats.failed_loads += 1
                        self._load_seconds.append((tier.name, time.perf_counter() - t0))
                    return out
                out.append(data)
                with self._lock:
                    self.stats.hit_tokens[tier.name] = self.stats.hit_tokens.get(tier.name, 0) + self.block_size
            with self._lock:
                self._load_seconds.append((tier.name, time.perf_counter() - t0))
        return out

    def snapshot(self) -> OffloadSnapshot:
        """Totals for the metrics (the per-run load times are handed over once)."""
        with self._lock:
            seconds, self._load_seconds = self._load_seconds, []
            loaded = dict(self.stats.hit_tokens)
        tiers = {t.name: TierSnapshot(t.stats.queries * self.block_size, t.stats.hits * self.block_size,
                                      t.stats.bytes_stored, t.stats.bytes_loaded, dict(t.stats.errors))
                 for t in self.tiers}
        return OffloadSnapshot(tiers, loaded, self.stats.stores_dropped, seconds)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the lookups of admitted, finished or aborted requests (a running fetch completes and is
        dropped)."""
        for rid in request_ids:
            self._fetches.pop(rid, None)

    @property
    def num_fetching(self) -> int:
        """Requests whose background fetch has not finished."""
        return sum(1 for f in self._fetches.values() if f.future is not None and not f.future.done())

    # ---- stores (engine thread -> writer thread) -------------------------------------------------
    def offer(self, blocks: Sequence[tuple[BlockHash, bytes, bool]]) -> None:
        """Queue blocks for the tiers: ``(hash, payload, evicted)``; evicted blocks go to the local tiers
        (cpu and disk), published ones (``evicted`` False) to the remote tiers. Never blocks."""
        for item in blocks:
            if self._closed:  # nobody writes any more
                self.stats.stores_dropped += 1
                continue
            key, payload, evicted = item
            try:
                if evicted and self._first_local is not None:
                    with self._lock:
                        self._pending[bytes(key)] = payload
                self._queue.put_nowait(item)
                self.stats.stores_queued += 1
            except queue.Full:
                if evicted:
                    self._unpend(bytes(key), payload)
                self.stats.stores_dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, payload, evicted = item
                try:
                    for tier in self.local if evicted else self.remote:
                        tier.store(bytes(key), payload)
                finally:
                    if evicted:
                        self._unpend(bytes(key), payload)
            except Exception:  # noqa: BLE001 - a tier bug must not kill the writer
                logger.exception("kv offload: storing a block failed")
            finally:
                self._queue.task_done()

    def _unpend(self, key: bytes, payload: bytes) -> None:
        """Forget a queued block once stored (or dropped); a newer queued copy of the same key stays."""
        with self._lock:
            if self._pending.get(key) is payload:
                del self._pending[key]

    @property
    def num_pending(self) -> int:
        """Evicted blocks queued for the local tiers and not yet stored."""
        with self._lock:
            return len(self._pending)

    def flush(self) -> None:
        """Wait until every queued block has been stored (tests, shutdown); returns at once after ``close``."""
        if not self._closed:
            self._queue.join()

    def wait_fetches(self, timeout_s: float) -> None:
        """Block until a background fetch finishes or ``timeout_s`` passes (an idle engine waiting for its
        loads sleeps here instead of spinning, which would starve the fetch threads)."""
        pending = [f.future for f in self._fetches.values() if f.future is not None and not f.future.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Store what is queued, stop the threads and close the tiers."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=30)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for tier in self.tiers:
            tier.close()
