"""The GGUF block formats ``--quantization gguf`` serves, and the sizes of their packed layout (no torch: the
planner counts served bytes with these).

    format  elems  bytes  fields (byte offset: size)                      value of element e
    Q4_0     32     18    d 0:2, qs 2:16                                  d (q - 8)
    Q4_1     32     20    d 0:2, m 2:2, qs 4:16                           d q + m
    Q5_0     32     22    d 0:2, qh 2:4, qs 6:16                          d (q - 16)      (bit e of qh: q's bit 4)
    Q8_0     32     34    d 0:2, qs 2:32                                  d q             (qs int8)
    Q4_K    256    144    d 0:2, dmin 2:2, scales 4:12, qs 16:128         d sc_j q - dmin m_j   (6-bit sc, m / 32)
    Q6_K    256    210    ql 0:128, qh 128:64, scales 192:16, d 208:2     d sc_t (q - 32)       (int8 sc / 16)

(nibble formats: byte b of a 32-element block's qs holds element b in its low nibble and b + 16 in its high one;
Q4_K / Q6_K as in ggml's ``dequantize_row_q4_K`` / ``_q6_K``.) ``fields`` lists them in the packed layout's order
(``csrc/gguf_gemm.c``): in the order the kernel reads them, so that it streams each block of 16 rows front to back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

ROWS = 16  # output rows per row block
ALIGN = 64  # bytes: each segment of a GGUFLinear's buffer starts on a cache line


class BlockFormat(NamedTuple):
    """One GGUF block format: ggml type id, name, elements and bytes per block, fields in packed order as
    ``(name, byte offset in the block, size, unit)`` (unit 4: regrouped 4 bytes per row; 2: one f16 per row)."""

    code: int
    name: str
    elems: int
    nbytes: int
    fields: tuple[tuple[str, int, int, int], ...]


FORMATS: dict[int, BlockFormat] = {f.code: f for f in (
    BlockFormat(2, "Q4_0", 32, 18, (("qs", 2, 16, 4), ("d", 0, 2, 2))),
    BlockFormat(3, "Q4_1", 32, 20, (("qs", 4, 16, 4), ("d", 0, 2, 2), ("m", 2, 2, 2))),
    BlockFormat(6, "Q5_0", 32, 22, (("qs", 6, 16, 4), ("qh", 2, 4, 4), ("d", 0, 2, 2))),
    BlockFormat(8, "Q8_0", 32, 34, (("qs", 2, 32, 4), ("d", 0, 2, 2))),
    BlockFormat(12, "Q4_K", 256, 144, (("scales", 4, 12, 4), ("d", 0, 2, 2), ("dmin", 2, 2, 2), ("qs", 16, 128, 4))),
    BlockFormat(14, "Q6_K", 256, 210,
                (("scales", 192, 16, 4), ("ql", 0, 128, 4), ("qh", 128, 64, 4), ("d", 208, 2, 2))),
)}
FORMAT_NAMES = ", ".join(f.name for f in FORMATS.values())
# ggml's other type ids, for error messages (gguf.GGMLQuantizationType without importing the package)
_OTHER_NAMES = {0: "F32", 1: "F16", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 13: "Q5_K", 15: "Q8_K", 30: "BF16"}


def block_format(code: int, what: str = "a tensor") -> BlockFormat:
    """The format of ggml type id ``code``.

    Raises:
        ValueError: a type ``--quantization gguf`` does not serve (the message names ``what`` and the formats).
    """
    if code not in FORMATS:
        name = _OTHER_NAMES.get(code, f"ggml type {code}")
        raise ValueError(f"quantization: gguf serves {FORMAT_NAMES} blocks; {what} is {name} (serve this file "
                         "without --quantization to dequantize it at load)")
    return FORMATS[code]


def rowblock_nbytes(code: int, k: int) -> int:
    """Bytes of one row block (16 rows) of an ``[*, k]`` weight.

    Raises:
        ValueError: an unsupported format, or k not a multiple of the format's block.
    """
    f = block_format(code)
    if k <= 0 or k % f.elems:
        raise ValueError(f"quantization: a {f.name} row needs a multiple of {f.elems} columns, got {k}")
    return ROWS * (k // f.elems) * f.nbytes


def packed_nbytes(code: int, n: int, k: int) -> int:
    """Bytes of the packed layout of an ``[n, k]`` weight (rows padded to 16 with zero blocks)."""
    return -(-n // ROWS) * rowblock_nbytes(code, k)


def merge_segments(segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ``(format, rows)`` parts of one format become one segment: ``[(Q5_0, 896), (Q5_0, 128), (Q8_0,
    128)]`` -> ``[(Q5_0, 1024), (Q8_0, 128)]``."""
    out: list[tuple[int, int]] = []
    for code, rows in segments:
        if out and out[-1][0] == code:
            out[-1] = (code, out[-1][1] + rows)
        else:
            out.append((code, rows))
    return out


def linear_nbytes(segments: Sequence[tuple[int, int]], k: int) -> int:
    """Bytes of a ``GGUFLinear``'s buffer: its merged segments, each padded to ``ALIGN``."""
    return sum(-(-packed_nbytes(code, rows, k) // ALIGN) * ALIGN for code, rows in merge_segments(segments))
