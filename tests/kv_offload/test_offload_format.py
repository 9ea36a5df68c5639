"""The stored form of a block: round trip, and every reason a value is refused."""

from __future__ import annotations

import struct
import zlib

import msgspec
import numpy as np
import pytest
from offload_helpers import META, key, payload

from kvserve.kv_offload import format as fmt
from kvserve.kv_offload.format import (
    CORRUPT_KINDS,
    FORMAT_VERSION,
    MAGIC,
    BlockHeader,
    CorruptBlockError,
    decode_block,
    decode_header,
    encode_block,
    make_header,
)
from kvserve.kv_offload.tier import BlockMeta


def encoded(i: int = 0, meta: BlockMeta = META) -> bytes:
    data = payload(i, meta)
    return encode_block(make_header(key(i), meta, data), data)


def kind_of(data: bytes, meta: BlockMeta = META, k: bytes | None = None) -> str:
    with pytest.raises(CorruptBlockError) as info:
        decode_block(data, meta, key(0) if k is None else k)
    assert info.value.kind in CORRUPT_KINDS
    return info.value.kind


def test_round_trip_returns_the_payload_and_a_readable_header() -> None:
    data = payload(0)
    blob = encode_block(make_header(key(0), META, data), data)
    out = decode_block(blob, META, key(0))
    assert out == data and isinstance(out, bytes)
    arr = np.frombuffer(out, dtype=np.float32).reshape(META.shape)
    assert np.array_equal(arr, np.frombuffer(data, dtype=np.float32).reshape(META.shape))
    header, offset = decode_header(blob)
    assert offset == len(blob) - META.nbytes == len(blob) - 512
    assert header.version == FORMAT_VERSION
    assert header.key == key(0).hex()
    assert (header.fingerprint, header.dtype, header.block_size, header.shape) == ("fp-model-a", "float32", 4,
                                                                                    [2, 2, 4, 1, 8])
    assert header.payload_len == 512
    assert header.checksum_algo == "xxh3_64"  # xxhash is a kvserve dependency
    assert blob[:4] == MAGIC
    # The header is msgpack (a map), not pickle: any msgpack reader can inspect it.
    head_len = struct.unpack_from("<I", blob, 4)[0]
    assert msgspec.msgpack.decode(blob[8:8 + head_len])["fingerprint"] == "fp-model-a"


def test_decode_accepts_memoryview_and_crc32_blocks() -> None:
    data = payload(1)
    header = msgspec.structs.replace(make_header(key(1), META, data), checksum_algo="crc32",
                                     checksum=zlib.crc32(data))
    blob = encode_block(header, data)
    assert decode_block(memoryview(blob), META, key(1)) == data


def test_flipped_payload_byte_is_a_checksum_error() -> None:
    blob = bytearray(encoded())
    blob[-1] ^= 0x01
    assert kind_of(bytes(blob)) == "checksum"
    blob = bytearray(encoded())
    blob[-META.nbytes] ^= 0x80  # the first payload byte
    assert kind_of(bytes(blob)) == "checksum"


def test_unknown_checksum_algorithm_is_a_checksum_error() -> None:
    data = payload(0)
    header = msgspec.structs.replace(make_header(key(0), META, data), checksum_algo="md5")
    assert kind_of(encode_block(header, data)) == "checksum"


def test_another_model_fingerprint_is_refused() -> None:
    other = BlockMeta("fp-model-b", META.dtype, META.block_size, META.shape)
    assert kind_of(encoded(0, other)) == "fingerprint"


def test_another_dtype_is_refused() -> None:
    # bfloat16 with twice the head_dim has the same byte size: only the header tells them apart.
    other = BlockMeta(META.fingerprint, "bfloat16", META.block_size, (2, 2, 4, 1, 16))
    assert other.nbytes == META.nbytes
    assert kind_of(encoded(0, other)) == "dtype"


@pytest.mark.parametrize("block_size, shape", [(4, (2, 2, 4, 2, 4)), (8, (2, 2, 4, 1, 8)), (8, (2, 2, 8, 1, 4))])
def test_another_shape_or_block_size_is_refused(block_size: int, shape: tuple[int, ...]) -> None:
    other = BlockMeta(META.fingerprint, META.dtype, block_size, shape)
    assert kind_of(encoded(0, other)) == "shape"


def test_a_value_of_another_block_is_a_key_error() -> None:
    assert kind_of(encoded(0), k=key(1)) == "key"


def test_another_format_version_is_refused() -> None:
    data = payload(0)
    raw = msgspec.to_builtins(make_header(key(0), META, data))
    raw["version"] = FORMAT_VERSION + 1
    raw["new_field"] = "from the future"
    head = msgspec.msgpack.encode(raw)
    blob = MAGIC + struct.pack("<I", len(head)) + head + data
    assert kind_of(blob) == "version"


@pytest.mark.parametrize("cut", [0, 3, 7, 8, 20, -1, -511])
def test_truncated_values_are_header_errors(cut: int) -> None:
    blob = encoded()
    assert kind_of(blob[:cut]) == "header"


def test_garbage_and_malformed_headers_are_header_errors() -> None:
    blob = encoded()
    assert kind_of(b"\x00" * 600) == "header"  # bad magic
    assert kind_of(b"XXXX" + blob[4:]) == "header"
    head = b"\xc1"  # a byte msgpack never uses
    assert kind_of(MAGIC + struct.pack("<I", 1) + head + payload(0)) == "header"
    head = msgspec.msgpack.encode([1, 2, 3])  # not a map
    assert kind_of(MAGIC + struct.pack("<I", len(head)) + head + payload(0)) == "header"
    raw = msgspec.to_builtins(make_header(key(0), META, payload(0)))
    raw["shape"] = "2x2x4x1x8"  # a field of the wrong type
    head = msgspec.msgpack.encode(raw)
    assert kind_of(MAGIC + struct.pack("<I", len(head)) + head + payload(0)) == "header"
    assert kind_of(MAGIC + struct.pack("<I", 10**9) + blob[8:]) == "header"  # a header longer than the value
    assert kind_of(blob + b"\x00") == "header"  # trailing bytes: the length disagrees


def test_encode_refuses_a_header_of_another_length() -> None:
    data = payload(0)
    with pytest.raises(ValueError, match="512 payload bytes, got 511"):
        encode_block(make_header(key(0), META, data), data[:-1])


def test_block_meta_validation_and_size() -> None:
    assert META.nbytes == 512
    assert BlockMeta("f", "bfloat16", 16, [30, 2, 16, 3, 64]).nbytes == 30 * 2 * 16 * 3 * 64 * 2
    assert BlockMeta("f", "bfloat16", 16, [30, 2, 16, 3, 64]).shape == (30, 2, 16, 3, 64)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        BlockMeta("f", "float13", 16, (1,))
    with pytest.raises(ValueError, match="block_size"):
        BlockMeta("f", "float32", 0, (1,))
    with pytest.raises(ValueError, match="shape"):
        BlockMeta("f", "float32", 4, (2, 0))
    with pytest.raises(ValueError, match="shape"):
        BlockMeta("f", "float32", 4, ())


def test_checksum_functions() -> None:
    assert fmt.checksum(b"abc", "crc32") == zlib.crc32(b"abc")
    assert fmt.checksum(b"abc", "xxh3_64") != fmt.checksum(b"abd", "xxh3_64")
    with pytest.raises(ValueError, match="unknown checksum"):
        fmt.checksum(b"abc", "sha1")
    assert isinstance(make_header(key(0), META, payload(0)), BlockHeader)
