"""Tiered KV offload: whole KV blocks, keyed by their chained block hash, kept beyond the device pool.

Modules (each torch-free):

- ``format``: a block's stored form, a msgpack header (format version, model fingerprint, dtype, block size,
  shape, length, checksum) followed by the raw payload bytes; ``CorruptBlockError`` says why a value is refused.
- ``tier``: the ``KVTier`` protocol, its ``TierStats`` and the measured ``LoadEstimator``.
- ``cpu`` (host-memory LRU), ``disk`` (one file per block, survives restarts), ``redis_tier`` (a Redis pool
  shared by instances; needs the ``offload`` extra: ``redis[hiredis]``).
- ``config``: ``KVOffloadConfig`` and ``build_tiers`` (cpu, disk, redis, in lookup order).

This package imports nothing on import, so that the engine can import ``config`` without the extras.
"""
