"""Chained block hashes for prefix caching (torch-free).

A full block's hash covers everything that decides its K/V: every token before it (through the parent
hash), its own tokens, and the extra keys of the root:

    root      = H("kvserve-prefix-v1" | model fingerprint | cache_salt | adapter id)
    hash[0]   = H(root    | token ids of block 0)
    hash[i]   = H(hash[i-1] | token ids of block i)

so two blocks are equal only if the whole prefix, the model (weights, config, tokenizer, KV dtype) and the
tenant salt are equal. This is vLLM's scheme (``hash_block_tokens``) with the extra keys moved into the
root, so that every block of a chain, not only the first, carries the salt and the fingerprint.
``sha256`` is the default (collision resistant: a collision would serve one tenant another's KV);
``xxhash`` (xxh3-128, the ``xxhash`` package) is faster and not cryptographic.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)
HashFn = Callable[[bytes], bytes]

HASH_ALGOS = ("sha256", "xxhash")


def get_hash_fn(algo: str) -> HashFn:
    """The digest function of ``--prefix-caching-hash-algo``.

    Raises:
        ValueError: an unknown algorithm name.
    """
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if algo == "xxhash":
        return xxhash.xxh3_128_digest
    raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; choose one of {HASH_ALGOS}")


def _field(value: str | None) -> bytes:
    # Length-prefixed, so that ("ab", "c") and ("a", "bc") differ; None differs from "".
    if value is None:
        return b"\xff"
    data = value.encode()
    return len(data).to_bytes(4, "little") + data


def root_hash(hash_fn: HashFn, fingerprint: str, cache_salt: str | None = None,
              adapter_id: str | None = None) -> BlockHash:
    """The parent hash of a request's first block: model fingerprint, tenant salt and adapter id."""
    return BlockHash(hash_fn(b"kvserve-prefix-v1" + _field(fingerprint) + _field(cache_salt) + _field(adapter_id)))


def hash_block(hash_fn: HashFn, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: its parent's hash and its ``block_size`` token ids (int64 little-endian)."""
    return BlockHash(hash_fn(parent + array("q", token_ids).tobytes()))


def extend_block_hashes(hash_fn: HashFn, hashes: list[BlockHash], root: BlockHash, token_ids: Sequence[int],
                        block_size: int) -> None:
    """Append to ``hashes`` the hashes of every full block of ``token_ids`` not hashed yet (in place).

    ``hashes`` must be the hashes of the first ``len(hashes)`` blocks of ``token_ids`` (a request's tokens
    only grow, so its hashes are computed once each).
    """
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block(hash_fn, parent, token_ids[i * block_size:(i + 1) * block_size]))
