"""The serialized form of one KV block in an offload tier (torch-free; never pickle).

Layout of a stored value::

    b"KVB1" | header length (u32, little-endian) | msgpack header (BlockHeader) | payload (raw KV bytes)

The header names what the payload is (model fingerprint, dtype, block size, shape) and carries its length
and checksum, so that a reader refuses a value that is damaged, truncated, written by another model or
another KV dtype, or stored under the wrong key. The payload is the block's K/V exactly as the engine laid
it out in memory (e.g. shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]``, C order); this module
does not interpret it.

The checksum is xxh3-64 of the payload when the ``xxhash`` package is importable (kvserve depends on it),
else CRC-32 (``zlib``); the header records which, so a reader verifies either.
"""

from __future__ import annotations

import struct
import zlib
from types import ModuleType
from typing import Literal

import msgspec

from kvserve.kv_offload.tier import DTYPE_ITEMSIZE, BlockMeta

_xxhash: ModuleType | None
try:  # xxhash is a kvserve dependency; the zlib fallback keeps this module usable without it.
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only where xxhash is missing
    _xxhash = None

FORMAT_VERSION = 1
MAGIC = b"KVB1"
_PREFIX = struct.Struct("<4sI")  # magic, header length in bytes
_MAX_HEADER_BYTES = 64 * 1024

CorruptKind = Literal["header", "checksum", "fingerprint", "dtype", "shape", "key", "version"]
CORRUPT_KINDS: tuple[str, ...] = ("header", "checksum", "fingerprint", "dtype", "shape", "key", "version")
__all__ = ["BlockHeader", "BlockMeta", "CorruptBlockError", "DTYPE_ITEMSIZE", "decode_block", "encode_block",
           "make_header"]

CHECKSUM_ALGO = "xxh3_64" if _xxhash is not None else "crc32"


class CorruptBlockError(ValueError):
    """A stored value is not the block that was asked for; ``kind`` says why (one of ``CORRUPT_KINDS``)."""

    def __init__(self, kind: CorruptKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: CorruptKind = kind


class BlockHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The msgpack header in front of a block's payload (see the module docstring)."""

    version: int
    key: str  # the block hash, hex
    fingerprint: str
    dtype: str
    block_size: int
    shape: list[int]
    payload_len: int  # bytes
    checksum_algo: str  # "xxh3_64" | "crc32"
    checksum: int


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder()  # untyped first: the version is checked before the field types


def checksum(payload: bytes | memoryview, algo: str = CHECKSUM_ALGO) -> int:
    """The checksum of ``payload`` with ``algo`` (``"xxh3_64"`` or ``"crc32"``).

    Raises:
        ValueError: an unknown algorithm, or ``xxh3_64`` without the ``xxhash`` package.
    """
    if algo == "xxh3_64":
        if _xxhash is None:
            raise ValueError("xxh3_64 needs the xxhash package")
        return int(_xxhash.xxh3_64_intdigest(payload))
    if algo == "crc32":
        return zlib.crc32(payload) & 0xFFFFFFFF
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def make_header(key: bytes, meta: BlockMeta, payload: bytes | memoryview) -> BlockHeader:
    """The header of ``payload`` stored under ``key`` (the block hash) for an engine described by ``meta``."""
    return BlockHeader(version=FORMAT_VERSION, key=bytes(key).hex(), fingerprint=meta.fingerprint,
                       dtype=meta.dtype, block_size=meta.block_size, shape=list(meta.shape),
                       payload_len=len(payload), checksum_algo=CHECKSUM_ALGO, checksum=checksum(payload))


def encode_block(header: BlockHeader, payload: bytes | memoryview) -> bytes:
    """Serialize ``header`` and ``payload`` into one value (see the module docstring for the layout).

    Raises:
        ValueError: ``header.payload_len`` is not ``len(payload)``.
    """
    if header.payload_len != len(payload):
        raise ValueError(f"header says {header.payload_len} payload bytes, got {len(payload)}")
    head = _header_encoder.encode(header)
    return b"".join((_PREFIX.pack(MAGIC, len(head)), head, payload))


def decode_header(data: bytes | memoryview) -> tuple[BlockHeader, int]:
    """Parse the prefix and header of a stored value: ``(header, payload offset in bytes)``.

    Raises:
        CorruptBlockError: ``"header"`` (no magic, truncated, not msgpack, wrong fields) or ``"version"``
            (another format version).
    """
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise CorruptBlockError("header", f"{len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlockError("header", f"bad magic {bytes(magic)!r}")
    end = _PREFIX.size + head_len
    if head_len > _MAX_HEADER_BYTES or end > len(view):
        raise CorruptBlockError("header", f"header of {head_len} bytes does not fit a {len(view)}-byte value")
    try:
        raw = _header_decoder.decode(view[_PREFIX.size:end])
    except msgspec.DecodeError as e:
        raise CorruptBlockError("header", f"not msgpack: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("version"), int):
        raise CorruptBlockError("header", "no format version")
    if raw["version"] != FORMAT_VERSION:
        raise CorruptBlockError("version", f"format version {raw['version']}, this reader knows {FORMAT_VERSION}")
    try:
        header = msgspec.convert(raw, BlockHeader)
    except msgspec.ValidationError as e:
        raise CorruptBlockError("header", str(e)) from None
    return header, end


def decode_block(data: bytes | memoryview, expect: BlockMeta, key: bytes) -> bytes:
    """Validate a stored value against the block asked for and return its payload (a copy, bytes).

    Args:
        data: the value as read from the tier.
        expect: what this engine's blocks look like.
        key: the block hash the value was stored under.

    Raises:
        CorruptBlockError: with ``kind`` ``"header"`` (unparsable or truncated), ``"version"``, ``"key"``
            (the value belongs to another block), ``"fingerprint"`` (another model), ``"dtype"``, ``"shape"``
            (another block size or layout) or ``"checksum"`` (damaged payload).
    """
    header, offset = decode_header(data)
    if header.key != bytes(key).hex():
        raise CorruptBlockError("key", f"value is block {header.key[:16]}…, asked for {bytes(key).hex()[:16]}…")
    if header.fingerprint != expect.fingerprint:
        raise CorruptBlockError("fingerprint", f"written by model {header.fingerprint!r}, "
                                               f"this engine is {expect.fingerprint!r}")
    if header.dtype != expect.dtype:
        raise CorruptBlockError("dtype", f"KV dtype {header.dtype}, expected {expect.dtype}")
    if header.block_size != expect.block_size or tuple(header.shape) != expect.shape:
        raise CorruptBlockError("shape", f"block_size {header.block_size} shape {header.shape}, expected "
                                         f"{expect.block_size} {list(expect.shape)}")
    payload = memoryview(data)[offset:]
    if len(payload) != header.payload_len or header.payload_len != expect.nbytes:
        raise CorruptBlockError("header", f"{len(payload)} payload bytes, header says {header.payload_len}, "
                                          f"expected {expect.nbytes}")
    try:
        ok = checksum(payload, header.checksum_algo) == header.checksum
    except ValueError as e:
        raise CorruptBlockError("checksum", str(e)) from None
    if not ok:
        raise CorruptBlockError("checksum", "payload checksum mismatch")
    return bytes(payload)
