"""GGUF block formats kept as they are (``--quantization gguf``): repacking, dequantization, the torch reference.

A GGUF file stores a quantized ``[N, K]`` weight row by row, each row as ``K / block_elems`` blocks of
``block_bytes`` bytes (an f16 scale or two, packed codes); ``gguf_formats.py`` lists the six formats served natively
(Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) and their fields.

For the kernel (``csrc/gguf_gemm.c``, whose header has the diagram) the blocks are regrouped per 16 rows, field by
field, 4 bytes of each row per 64-byte vector: ``pack`` / ``unpack_rows`` are exact inverses on the bytes (Q8_0's
codes are stored as ``q + 128``, bit 7 flipped, for ``vpdpbusd``'s unsigned operand). ``dequantize`` repeats the
``gguf`` package's float32 operations in its order, so its values equal ``gguf.quants.dequantize`` bit for bit;
in float64 it gives the formats' exact values (every product above is exact there).

``gguf_linear_reference`` is the torch path of the linear (CUDA, no C compiler, ``KVSERVE_DISABLE_NATIVE=1``) and,
in float64, the oracle of the kernel: it quantizes the activations exactly as the kernel does
(``int8.quantize_rows``: per token and group of 32) and multiplies them with the dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.layers import int8
from kvserve.layers.gguf_formats import ROWS, BlockFormat, block_format, rowblock_nbytes


@dataclass(frozen=True)
class GGUFTensor:
    """A weight kept in its GGUF blocks: ``data`` ``[rows, K / elems * nbytes]`` uint8, the file's bytes of each row
    (rows in HF order: llama's q/k row permutation already undone)."""

    code: int
    rows: int
    cols: int
    data: torch.Tensor

    @property
    def format(self) -> BlockFormat:
        return block_format(self.code)


def _field_views(rb: torch.Tensor, f: BlockFormat, nb: int) -> list[torch.Tensor]:
    """Views of a ``[R, rowblock bytes]`` tensor, one per field: ``[R, nb, size / unit, 16, unit]`` (each block of
    16 rows is its fields one after another)."""
    tiles = rb.view(rb.shape[0], nb, ROWS * f.nbytes)
    views, off = [], 0
    for _, _, size, unit in f.fields:
        views.append(tiles[:, :, off:off + ROWS * size].view(rb.shape[0], nb, size // unit, ROWS, unit))
        off += ROWS * size
    return views


def pack(data: torch.Tensor, code: int) -> torch.Tensor:
    """The file's blocks of an ``[n, k]`` weight -> the kernel's row-block layout (``csrc/gguf_gemm.c``).

    Args:
        data: ``[n, k / elems * nbytes]`` uint8.
    Returns:
        ``[packed_nbytes(code, n, k)]`` uint8 (a new tensor).
    """
    f = block_format(code)
    n, row_bytes = data.shape
    nb = row_bytes // f.nbytes
    np_ = -(-n // ROWS) * ROWS
    blocks = torch.zeros(np_, nb, f.nbytes, dtype=torch.uint8, device=data.device)
    blocks[:n] = data.view(n, nb, f.nbytes)
    blocks = blocks.view(np_ // ROWS, ROWS, nb, f.nbytes)
    out = torch.empty(np_ // ROWS, rowblock_nbytes(code, nb * f.elems), dtype=torch.uint8, device=data.device)
    for view, (name, off, size, unit) in zip(_field_views(out, f, nb), f.fields, strict=True):
        src = blocks[..., off:off + size].reshape(np_ // ROWS, ROWS, nb, size // unit, unit)
        view.copy_(src.permute(0, 2, 3, 1, 4))
        if f.name == "Q8_0" and name == "qs":
            view.bitwise_xor_(0x80)  # q + 128: vpdpbusd's unsigned operand
    return out.view(-1)


def unpack_rows(packed: torch.Tensor, code: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``pack``'s inverse for some rows: the file's bytes of rows ``rows`` (default: all rows of the buffer).

    Args:
        packed: a ``pack`` output (or a segment of one), uint8.
        rows: int64 row indices.
    Returns:
        ``[len(rows), k / elems * nbytes]`` uint8.
    """
    f = block_format(code)
    nb = k // f.elems
    rb = packed.view(-1, rowblock_nbytes(code, k))
    if rows is None:
        rows = torch.arange(rb.shape[0] * ROWS, device=packed.device)
    blk, i = rows // ROWS, rows % ROWS
    out = torch.empty(rows.shape[0], nb, f.nbytes, dtype=torch.uint8, device=packed.device)
    for view, (name, off, size, _) in zip(_field_views(rb, f, nb), f.fields, strict=True):
        got = view[blk, :, :, i, :].reshape(rows.shape[0], nb, size)  # [R, nb, size / unit, unit] -> bytes
        out[..., off:off + size] = got ^ 0x80 if f.name == "Q8_0" and name == "qs" else got
    return out.view(rows.shape[0], nb * f.nbytes)


def _f16(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., 2]`` little-endian f16 bytes -> ``[..., 1]`` values."""
    return b.contiguous().view(torch.float16).to(dtype)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]``: the n low nibbles, then the n high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize(data: torch.Tensor, code: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of GGUF blocks, computed as ``gguf.quants.dequantize`` does (float32: its bits; float64: exact).

    Args:
        data: ``[R, k / elems * nbytes]`` uint8 (the file's bytes of R rows).
    Returns:
        ``[R, k]`` in ``dtype``.
    """
    f = block_format(code)
    r = data.shape[0]
    b = data.view(r, -1, f.nbytes)  # [R, nb, nbytes]
    if f.name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        d = _f16(b[..., 0:2], dtype)
        if f.name == "Q8_0":
            q = b[..., 2:34].contiguous().view(torch.int8).to(dtype)
            return (q * d).view(r, -1)
        q16 = _nibbles(b[..., f.fields[0][1]:f.fields[0][1] + 16]).to(torch.int16)  # [R, nb, 32]
        if f.name == "Q4_1":
            return (d * q16.to(dtype) + _f16(b[..., 2:4], dtype)).view(r, -1)
        if f.name == "Q5_0":
            # bit e of the 4 bytes (a little-endian 32-bit word): q's bit 4 of element e
            qh = b[..., 2:6].contiguous().view(torch.int32)  # [R, nb, 1]
            bits = ((qh >> torch.arange(32, dtype=torch.int32, device=data.device)) & 1).to(torch.int16)
            return (d * (q16 + (bits << 4) - 16).to(dtype)).view(r, -1)
        return (d * (q16 - 8).to(dtype)).view(r, -1)
    if f.name == "Q4_K":
        d, dmin = _f16(b[..., 0:2], dtype), _f16(b[..., 2:4], dtype)
        s = b[..., 4:16]
        lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
        sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).to(dtype)  # [R, nb, 8]
        mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1).to(dtype)
        q = _nibbles(b[..., 16:144].reshape(r, -1, 4, 32)).view(r, -1, 8, 32).to(dtype)  # [R, nb, 8 groups, 32]
        return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).view(r, -1)
    # Q6_K: two halves of 128 = 4 groups of 32: low nibbles of ql[0:32], ql[32:64], high nibbles of both; bits
    # 0-1, 2-3, 4-5, 6-7 of qh[0:32] give each group's two high bits.
    ql = b[..., 0:128].reshape(r, -1, 2, 64)
    qh = b[..., 128:192].reshape(r, -1, 2, 1, 32)
    lo4 = _nibbles(ql).view(r, -1, 2, 4, 32)
    hi2 = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=data.device).view(4, 1)) & 3
    q = ((lo4 | (hi2 << 4)).to(torch.int16) - 32).view(r, -1, 16, 16).to(dtype)  # [R, nb, 16 sub-blocks, 16]
    scales = b[..., 192:208].contiguous().view(torch.int8).to(dtype)  # [R, nb, 16]
    return ((_f16(b[..., 208:210], dtype) * scales)[..., None] * q).view(r, -1)


def gguf_linear_reference(x: torch.Tensor, segments: list[tuple[int, torch.Tensor]], bias: torch.Tensor | None,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch GGUF linear: activations quantized per token and group of 32 (as the kernel), weights dequantized,
    one matmul in ``dtype``.

    Args:
        x: ``[M, K]`` float (K a multiple of 32). segments: ``(format code, file bytes [rows, row bytes])`` in output
            order. bias: ``[N]`` or None.
        dtype: float32 (the serving path) or float64 (the tests' oracle: exact up to the final rounding).
    Returns:
        ``[M, N]`` in x's dtype.
    """
    xq, xs = int8.quantize_rows(x)
    m, k = xq.shape
    xd = (xq.to(dtype).view(m, -1, int8.GROUP) * xs.to(dtype)[..., None]).view(m, k)
    w = torch.cat([dequantize(data, code, dtype) for code, data in segments])
    out = xd @ w.T
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(x.dtype)


def from_numpy_rows(arr: np.ndarray) -> torch.Tensor:
    """A ``[rows, row bytes]`` uint8 array (e.g. a read-only view of a memory-mapped file) -> a torch copy."""
    return torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True))
