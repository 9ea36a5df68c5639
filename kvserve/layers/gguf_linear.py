"""Linear and embedding layers over GGUF blocks (``--quantization gguf``), kept as the file stores them.

``GGUFLinear`` holds one byte buffer with one or more segments, each a block of output rows in one format (a fused
projection's parts may differ: Qwen2.5-Coder-0.5B has q/k in Q5_0 and v in Q8_0), each in ``gguf_blocks.pack``'s
row-block layout, 64-byte aligned::

    packed  | segment 0: rows [0, n0), format f0 | pad | segment 1: rows [n0, n0 + n1), format f1 | ...

Its forward is one ``gguf_gemm`` call (activations quantized once for all segments) on CPU, or
``gguf_linear_reference`` elsewhere (CUDA, no C compiler, ``KVSERVE_DISABLE_NATIVE=1``). ``GGUFEmbedding`` looks
rows up by dequantizing only those rows (float32, the values of ``gguf.quants.dequantize``); a tied LM head is a
``GGUFLinear`` sharing the table's buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvserve.layers import cpu_kernels
from kvserve.layers.gguf_blocks import GGUFTensor, dequantize, gguf_linear_reference, pack, unpack_rows
from kvserve.layers.gguf_formats import ALIGN, block_format, merge_segments, packed_nbytes


class GGUFLinear(nn.Module):
    """A linear layer whose weight is GGUF blocks; same ``forward`` contract as ``nn.Linear``.

    Args:
        in_features: K (a multiple of each segment format's block: 32 or 256).
        segments: ``(ggml type id, rows)`` of each part of the output, in order (adjacent parts of one format are
            merged).
        bias: whether the layer has a bias (a float parameter, like ``nn.Linear``'s).
    Raises:
        ValueError: an unsupported format, or K not a multiple of its block.
    """

    packed: torch.Tensor

    def __init__(self, in_features: int, segments: Sequence[tuple[int, int]], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.segments = merge_segments(segments)
        self.out_features = sum(rows for _, rows in self.segments)
        self.offsets: list[int] = []
        total = 0
        for code, rows in self.segments:
            self.offsets.append(total)
            total += -(-packed_nbytes(code, rows, in_features) // ALIGN) * ALIGN
        self.register_buffer("packed", torch.zeros(total, dtype=torch.uint8))
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None)
        self._table: tuple[int, torch.Tensor] | None = None

    def load_segments(self, parts: Sequence[GGUFTensor]) -> None:
        """Pack the file's blocks of each part (e.g. q, k, v), in output order.

        Raises:
            ValueError: parts whose formats or shapes do not match the layer's.
        """
        merged = merge_segments([(p.code, p.rows) for p in parts])
        if merged != self.segments or any(p.cols != self.in_features for p in parts):
            raise ValueError(f"gguf linear: expected segments {self._describe(self.segments)} x {self.in_features}, "
                             f"got {self._describe(merged)} x {[p.cols for p in parts]}")
        i = 0
        for (code, rows), off in zip(self.segments, self.offsets, strict=True):
            data: list[torch.Tensor] = []
            while sum(d.shape[0] for d in data) < rows:
                data.append(parts[i].data)
                i += 1
            blob = pack(torch.cat(data).to(self.packed.device), code)
            with torch.no_grad():
                self.packed[off:off + blob.numel()].copy_(blob)

    def tie_to(self, embedding: GGUFEmbedding) -> None:
        """Share the embedding table's buffer (a tied LM head: one segment of the table's format)."""
        assert self.segments == [(embedding.code, embedding.num_embeddings)]
        assert embedding.embedding_dim == self.in_features
        self.packed = embedding.packed

    @staticmethod
    def _describe(segments: Sequence[tuple[int, int]]) -> str:
        return "[" + ", ".join(f"{block_format(c).name} x {r}" for c, r in segments) + "]"

    def segment_table(self) -> torch.Tensor:
        """The kernel's int64 table ``[S, (format, rows, address) x S]`` (rebuilt when the buffer moves)."""
        ptr = self.packed.data_ptr()
        if self._table is None or self._table[0] != ptr:
            values = [len(self.segments)]
            for (code, rows), off in zip(self.segments, self.offsets, strict=True):
                values += [code, rows, ptr + off]
            self._table = (ptr, torch.tensor(values, dtype=torch.int64))
        return self._table[1]

    def blocks(self) -> list[tuple[int, torch.Tensor]]:
        """``(format, file bytes [rows, row bytes])`` of each segment, unpacked from the buffer."""
        out = []
        for (code, rows), off in zip(self.segments, self.offsets, strict=True):
            n = packed_nbytes(code, rows, self.in_features)
            out.append((code, unpack_rows(self.packed[off:off + n], code, self.in_features)[:rows]))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, in_features]`` -> ``[M, out_features]`` in x's dtype."""
        bias = None if self.bias is None else self.bias.float()
        if x.dim() == 2 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) \
                and cpu_kernels.native_available():
            return cpu_kernels.gguf_gemm(x, self.segment_table(), self.out_features, bias)
        shape = x.shape
        out = gguf_linear_reference(x.reshape(-1, shape[-1]), self.blocks(), bias)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"segments={self._describe(self.segments)}, bias={self.bias is not None}")


class GGUFEmbedding(nn.Module):
    """An embedding table in GGUF blocks: ``forward(ids)`` dequantizes the looked-up rows only.

    Args:
        num_embeddings, embedding_dim: the table's shape (embedding_dim a multiple of the format's block).
        code: the ggml type id of its blocks.
    """

    packed: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int, code: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.code = code
        self.register_buffer("packed", torch.zeros(packed_nbytes(code, num_embeddings, embedding_dim),
                                                   dtype=torch.uint8))

    def load(self, t: GGUFTensor) -> None:
        """Pack the file's table.

        Raises:
            ValueError: another format or shape.
        """
        if (t.code, t.rows, t.cols) != (self.code, self.num_embeddings, self.embedding_dim):
            raise ValueError(f"gguf embedding: expected {block_format(self.code).name} "
                             f"[{self.num_embeddings}, {self.embedding_dim}], got {block_format(t.code).name} "
                             f"[{t.rows}, {t.cols}]")
        with torch.no_grad():
            self.packed.copy_(pack(t.data.to(self.packed.device), self.code))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (any shape, int64) -> ``[*ids.shape, embedding_dim]`` float32."""
        flat = ids.reshape(-1)
        rows = dequantize(unpack_rows(self.packed, self.code, self.embedding_dim, flat), self.code)
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={block_format(self.code).name}"
