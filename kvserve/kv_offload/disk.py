"""The local-disk tier: one file per block under a directory, LRU by access time, kept across restarts.

File names are ``<hex key>.kvb``; each file is a block in the ``format.py`` layout (header + payload), so a
file from another model, dtype or a torn write is refused when read. A write goes to a temporary file in the
same directory, then ``os.replace`` (atomic): a reader never sees a partial block under its name. A load
sets the file's mtime to now ("touch"), so that after a restart the index, rebuilt by scanning the
directory, orders the blocks by last use. One directory belongs to one server (two servers sharing one
would evict each other's files without knowing).

A directory that cannot be created, or a write that fails (disk full, no permission, the directory gone),
turns the tier off with one warning: from then on every call is a miss or a refused store
(``errors["off"]``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvserve.kv_offload.format import CorruptBlockError, decode_block, encode_block, make_header
from kvserve.kv_offload.tier import BlockMeta, LoadEstimator, TierStats

logger = logging.getLogger(__name__)

GIB = 1 << 30
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 600.0  # temp files older than this at start are leftovers of a crash


class DiskTier:
    """Blocks as files under ``path``, at most ``capacity_bytes`` of file bytes (header included)."""

    name = "disk"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, meta: BlockMeta) -> None:
        """Open (creating it if needed) the directory ``path`` and index the blocks already in it.

        Blocks beyond the capacity (a smaller capacity than last time) are evicted, oldest first. Never raises
        for a directory that cannot be created or read: the tier is then off (``enabled`` False).

        Raises:
            ValueError: a negative capacity.
        """
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.path = Path(path)
        self.capacity_bytes = int(capacity_bytes)
        self.meta = meta
        self.stats = TierStats()
        self.speed = LoadEstimator(prior_bytes_per_s=1e9, prior_latency_s=1e-4)
        self.off_reason: str | None = None
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._used = 0
        self._last_ns = 0
        self._lock = threading.Lock()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as e:
            self._turn_off(f"cannot use directory {self.path}: {e}")

    @classmethod
    def from_gib(cls, path: str | os.PathLike[str], gib: float, meta: BlockMeta) -> DiskTier:
        """A tier of ``gib`` GiB (2**30 bytes) under ``path``."""
        return cls(path, int(gib * GIB), meta)

    @property
    def enabled(self) -> bool:
        """False once the tier has turned itself off (see ``off_reason``)."""
        return self.off_reason is None

    @property
    def used_bytes(self) -> int:
        """File bytes of the blocks indexed now."""
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def keys_lru(self) -> list[bytes]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._index)

    def file_path(self, key: bytes) -> Path:
        """The file of block ``key``."""
        return self.path / (bytes(key).hex() + SUFFIX)

    def _touch(self, path: Path) -> None:
        # An explicit, strictly increasing time: the kernel's own file times are coarse (a few ms), too coarse
        # to order blocks used within one step.
        ns = self._last_ns = max(time.time_ns(), self._last_ns + 1)
        os.utime(path, ns=(ns, ns))

    def _scan(self) -> None:
        found: list[tuple[int, bytes, int]] = []
        now = time.time()
        with os.scandir(self.path) as it:
            for entry in it:
                name = entry.name
                try:
                    if name.startswith(TMP_PREFIX):
                        if now - entry.stat().st_mtime > _STALE_TMP_S:
                            os.unlink(entry.path)
                        continue
                    if not name.endswith(SUFFIX) or not entry.is_file():
                        continue
                    key = bytes.fromhex(name[:-len(SUFFIX)])
                    st = entry.stat()
                except (ValueError, OSError):  # a foreign name, or a file gone meanwhile
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        if found:
            self._last_ns = found[-1][0]
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        self._evict_to(self.capacity_bytes)

    def _evict_to(self, limit: int) -> None:
        while self._index and self._used > limit:
            key, size = self._index.popitem(last=False)
            self._used -= size
            self.stats.evictions += 1
            try:
                os.unlink(self.file_path(key))
            except FileNotFoundError:
                pass
            except OSError as e:  # it stays on disk, unindexed; not a reason to turn off
                logger.debug("kv offload disk: cannot remove %s: %s", self.file_path(key), e)

    def _turn_off(self, reason: str) -> None:
        if self.off_reason is None:
            self.off_reason = reason
            self.stats.count_error("io")
            logger.warning("kv offload disk tier turned off: %s", reason)

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def contains(self, keys: Sequence[bytes]) -> int:
        """The number of leading ``keys`` indexed (see ``KVTier.contains``; no disk access)."""
        with self._lock:
            n = 0
            if self.off_reason is None:
                for key in keys:
                    if key not in self._index:
                        break
                    n += 1
            self.stats.queries += len(keys)
            self.stats.hits += n
            return n

    def load(self, key: bytes) -> bytes | None:
        """The validated payload of block ``key`` (its file touched), or None when absent, unreadable
        (``errors["io"]``) or damaged (``errors[kind]``; the file is removed)."""
        start = time.perf_counter()
        with self._lock:
            self.stats.loads += 1
            if self.off_reason is not None:
                self.stats.count_error("off")
                self.stats.load_misses += 1
                return None
            if key not in self._index:
                self.stats.load_misses += 1
                return None
            self._index.move_to_end(key)
        path = self.file_path(key)
        try:
            data = path.read_bytes()
            payload = decode_block(data, self.meta, key)
        except (FileNotFoundError, CorruptBlockError, OSError) as e:
            with self._lock:
                self.stats.load_misses += 1
                if isinstance(e, FileNotFoundError):
                    self._forget(key)
                elif isinstance(e, CorruptBlockError):
                    self.stats.count_error(e.kind)
                    self._forget(key)
                    with contextlib.suppress(OSError):
                        path.unlink()
                    logger.debug("kv offload disk: dropped %s: %s", path.name, e)
                else:
                    self.stats.count_error("io")
            return None
        seconds = time.perf_counter() - start
        with self._lock, contextlib.suppress(OSError):  # evicted meanwhile: the payload is still good
            self._touch(path)
        with self._lock:
            self.stats.bytes_loaded += len(payload)
            self.stats.load_seconds += seconds
        self.speed.observe(len(payload), seconds)
        return payload

    def store(self, key: bytes, data: bytes) -> bool:
        """Write ``data`` as block ``key`` (temp file, then atomic rename), evicting the least recently used
        files to make room.

        Returns True when the block is on disk after the call; False for a payload that is not ``meta.nbytes``
        long (``errors["size"]``), a block larger than the capacity (``errors["too_big"]``), or a tier that is
        off. A failed write (``OSError``: disk full, no permission) turns the tier off and returns False.
        """
        with self._lock:
            if self.off_reason is not None:
                self.stats.count_error("off")
                return False
            if len(data) != self.meta.nbytes:
                self.stats.count_error("size")
                return False
            if key in self._index:
                self.stats.already_present += 1
                return True
        blob = encode_block(make_header(key, self.meta, data), data)
        if len(blob) > self.capacity_bytes:
            with self._lock:
                self.stats.count_error("too_big")
            return False
        path = self.file_path(key)
        tmp = self.path / f"{TMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            with self._lock:
                if self.off_reason is not None:
                    raise OSError("tier turned off during the write")
                self._evict_to(self.capacity_bytes - len(blob))
                os.replace(tmp, path)
                self._touch(path)
                if key not in self._index:
                    self._index[key] = len(blob)
                    self._used += len(blob)
                    self.stats.stores += 1
                    self.stats.bytes_stored += len(data)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._turn_off(f"write to {self.path} failed: {e}")
            return False
        return True

    def estimate_load_seconds(self, num_bytes: int, num_calls: int = 1) -> float:
        """Predicted seconds to load ``num_bytes`` bytes in ``num_calls`` loads."""
        return self.speed.estimate_load_seconds(num_bytes, num_calls)

    def close(self) -> None:
        """Stop using the directory (the files stay for the next start); later calls miss."""
        with self._lock:
            if self.off_reason is None:
                self.off_reason = "closed"
            self._index.clear()
            self._used = 0
