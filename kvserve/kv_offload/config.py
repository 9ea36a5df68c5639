"""Configuration of the KV offload tiers and the factory that builds them (cpu, disk, redis, in that order)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvserve.kv_offload.tier import BlockMeta, KVTier

DEFAULT_REDIS_PREFIX = "kvserve:"
DEFAULT_REDIS_TIMEOUT_S = 0.2
GIB = 1 << 30


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name}: {message}", param=name)


@dataclass(frozen=True)
class KVOffloadConfig:
    """Which offload tiers to run and how big they are. The defaults run none.

    Attributes:
        cpu_gib: host-memory tier capacity (GiB; 0 = no cpu tier).
        disk_path: directory of the disk tier (None = no disk tier).
        disk_gib: disk tier capacity (GiB; > 0 exactly when ``disk_path`` is set).
        redis_url: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or ``unix://`` (None = no
            redis tier). The password may instead come from ``KVSERVE_REDIS_PASSWORD``.
        redis_prefix: prefix of every Redis key, one per deployment (non-empty, no whitespace).
        redis_timeout_s: socket timeout of each Redis call (s, in (0, 60]).
        redis_ttl_s: expiry of published blocks (s; None = until the server evicts them).
        publish: publish blocks computed here to Redis (False = read-only instance).

    Raises:
        InvalidRequestError: a field out of range; ``param`` names it.
    """

    cpu_gib: float = 0.0
    disk_path: str | None = None
    disk_gib: float = 0.0
    redis_url: str | None = None
    redis_prefix: str = DEFAULT_REDIS_PREFIX
    redis_timeout_s: float = DEFAULT_REDIS_TIMEOUT_S
    redis_ttl_s: float | None = None
    publish: bool = True

    def __post_init__(self) -> None:
        _require(isinstance(self.cpu_gib, (int, float)) and math.isfinite(self.cpu_gib) and self.cpu_gib >= 0,
                 "cpu_gib", f"must be a finite number >= 0 GiB, got {self.cpu_gib!r}")
        _require(isinstance(self.disk_gib, (int, float)) and math.isfinite(self.disk_gib) and self.disk_gib >= 0,
                 "disk_gib", f"must be a finite number >= 0 GiB, got {self.disk_gib!r}")
        _require(self.disk_path is None or (isinstance(self.disk_path, str) and self.disk_path.strip() != ""),
                 "disk_path", f"must be a directory path, got {self.disk_path!r}")
        _require(self.disk_path is None or self.disk_gib > 0, "disk_gib",
                 f"must be > 0 GiB when disk_path is set, got {self.disk_gib}")
        _require(self.disk_path is not None or self.disk_gib == 0, "disk_path",
                 f"is required when disk_gib is set ({self.disk_gib} GiB)")
        if self.redis_url is not None:
            try:
                parts = urlsplit(self.redis_url)
                ok = parts.scheme in ("redis", "rediss", "unix") and (parts.scheme == "unix" or bool(parts.hostname))
                _ = parts.port  # raises ValueError for a non-numeric or out-of-range port
            except ValueError:
                ok = False
            # The message never repeats the URL: it may hold a password.
            _require(ok, "redis_url", "must be redis://host:port/db, rediss://host:port/db or unix://path")
        _require(isinstance(self.redis_prefix, str) and self.redis_prefix != ""
                 and not any(c.isspace() for c in self.redis_prefix),
                 "redis_prefix", f"must be a non-empty string without whitespace, got {self.redis_prefix!r}")
        _require(isinstance(self.redis_timeout_s, (int, float)) and 0 < self.redis_timeout_s <= 60,
                 "redis_timeout_s", f"must be in (0, 60] s, got {self.redis_timeout_s!r}")
        _require(self.redis_ttl_s is None or (isinstance(self.redis_ttl_s, (int, float)) and self.redis_ttl_s > 0
                                              and math.isfinite(self.redis_ttl_s)),
                 "redis_ttl_s", f"must be > 0 s or None, got {self.redis_ttl_s!r}")

    @property
    def enabled(self) -> bool:
        """True when at least one tier is configured."""
        return self.cpu_gib > 0 or self.disk_path is not None or self.redis_url is not None


def build_tiers(config: KVOffloadConfig, meta: BlockMeta) -> list[KVTier]:
    """The configured tiers in lookup order: cpu, disk, redis (those not configured are left out).

    Never connects to Redis here (the first call does); a disk directory that cannot be created gives a disk
    tier that is off (one warning), not an error.

    Raises:
        InvalidRequestError: ``disk_path`` or ``redis_url`` is set but the ``offload`` extra (``msgspec``,
            ``redis``) is not installed; ``param`` names the field.
    """
    tiers: list[KVTier] = []
    if config.cpu_gib > 0:
        from kvserve.kv_offload.cpu import CPUTier

        tiers.append(CPUTier(int(config.cpu_gib * GIB), meta))
    if config.disk_path is not None:
        try:
            from kvserve.kv_offload.disk import DiskTier
        except ImportError as e:
            raise InvalidRequestError(f"disk_path: the disk tier needs msgspec (pip install 'kvserve[offload]'): {e}",
                                      param="disk_path") from None
        tiers.append(DiskTier(config.disk_path, int(config.disk_gib * GIB), meta))
    if config.redis_url is not None:
        try:
            from kvserve.kv_offload.redis_tier import RedisTier
        except ImportError as e:
            raise InvalidRequestError(f"redis_url: the redis tier needs the redis package "
                                      f"(pip install 'kvserve[offload]'): {e}", param="redis_url") from None
        tiers.append(RedisTier(config.redis_url, meta, prefix=config.redis_prefix, timeout_s=config.redis_timeout_s,
                               ttl_s=config.redis_ttl_s, publish=config.publish))
    return tiers
