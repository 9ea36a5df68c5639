"""Block metas, keys and payloads shared by the kv_offload tests."""

from __future__ import annotations

import hashlib

import numpy as np

from kvserve.kv_offload.tier import BlockMeta

# [num_layers, 2, block_size, num_kv_heads, head_dim] float32: 2*2*4*1*8*4 = 512 bytes a block.
META = BlockMeta(fingerprint="fp-model-a", dtype="float32", block_size=4, shape=(2, 2, 4, 1, 8))


def key(i: int, salt: str = "") -> bytes:
    """A 32-byte block hash, as sha256 block hashes are."""
    return hashlib.sha256(f"{salt}block-{i}".encode()).digest()


def payload(i: int, meta: BlockMeta = META) -> bytes:
    """A distinct block payload of ``meta.nbytes`` bytes (K/V values of block ``i``)."""
    rng = np.random.default_rng(i)
    if meta.dtype == "float32":
        return rng.standard_normal(meta.shape, dtype=np.float32).tobytes()
    return rng.integers(0, 256, meta.nbytes, dtype=np.uint8).tobytes()
