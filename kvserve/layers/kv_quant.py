"""8-bit KV cache: the row layout, quantization on write and dequantization on read (the torch reference).

Two formats, named as vLLM's ``--kv-cache-dtype`` values:

* ``int8``: symmetric int8, ``scale = amax / 127`` per token and KV head, ``q = round(x / scale)``;
* ``fp8`` (= ``fp8_e4m3``): ``torch.float8_e4m3fn`` codes, ``scale = amax / 448`` per token and KV head, so
  the largest value of a row maps to e4m3's largest finite value and nothing saturates.

A row, one (token, KV head) of K or V, is its ``head_dim`` 8-bit codes followed by its float32 scale::

    byte  0 ........................ D-1 | D ... D+3
          q[0]  q[1]  ...  q[D-1]         | scale (float32, native byte order)
    x[d] ~= decode(q[d]) * scale            (decode: the int8 value, or the e4m3 value)

so a cache is ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` bytes: a block (and a payload of
the offload tiers or the PD transfer, a swap, a copy-on-write) carries its scales with its codes, and a
block copy needs no knowledge of the format. The storage dtype names the format: ``torch.int8`` for int8,
``torch.uint8`` for fp8 (raw e4m3fn bytes; torch has no CPU ``index_copy_`` for ``float8_e4m3fn``). The
engine's logical KV dtype is ``torch.int8`` or ``torch.float8_e4m3fn``; ``storage_dtype`` maps it.

The attention paths read rows directly: the torch path dequantizes only the blocks it gathers
(``dequantize``), the native kernels dequantize in registers (``csrc/kv8.h``).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the float32 scale after each row's codes
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# --kv-cache-dtype spelling -> the engine's logical KV dtype
KV8_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                                      "fp8_e4m3": torch.float8_e4m3fn}

_STORAGE = {torch.int8: torch.int8, torch.float8_e4m3fn: torch.uint8}
_QMAX = {torch.int8: INT8_MAX, torch.uint8: FP8_MAX}


def storage_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache tensors for a logical KV dtype (8-bit: int8 or uint8 bytes; others: itself)."""
    return _STORAGE.get(kv_dtype, kv_dtype)


def is_kv8(dtype: torch.dtype) -> bool:
    """True for an 8-bit KV dtype, logical (``int8``, ``float8_e4m3fn``) or storage (``int8``, ``uint8``)."""
    return dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn)


def row_elems(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row: ``head_dim``, plus the 4 scale bytes for an 8-bit dtype."""
    return head_dim + SCALE_BYTES if is_kv8(kv_dtype) else head_dim


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """KV bytes of one token over all layers, scales included:
    ``2 (K, V) × layers × kv_heads × row_elems × element_size``; 8-bit: ``2 L H (D + 4)``."""
    itemsize = torch.empty((), dtype=storage_dtype(kv_dtype)).element_size()
    return 2 * num_layers * num_kv_heads * row_elems(head_dim, kv_dtype) * itemsize


def format_code(cache: torch.Tensor) -> int:
    """The native kernels' format flag of a cache tensor: 0 float32, 1 bfloat16, 2 int8, 3 fp8 (uint8 bytes).

    Raises:
        TypeError: any other dtype.
    """
    codes = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}
    if cache.dtype not in codes:
        raise TypeError(f"no native KV format for {cache.dtype}")
    return codes[cache.dtype]


def quantize(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) -> ``[..., head_dim + 4]`` of ``storage`` (int8 or uint8).

    The scale is ``amax / 127`` (int8) or ``amax / 448`` (fp8) of each row, computed in float32; an all-zero
    row gets scale 1 (its codes are 0). Codes: ``round(x / scale)`` clamped to +-127, or ``x / scale`` clamped
    to +-448 and rounded to nearest-even e4m3fn.
    """
    qmax = _QMAX[storage]
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))  # [..., 1]
    y = (x32 / scale).clamp_(-qmax, qmax)
    codes = y.round_().to(torch.int8) if storage == torch.int8 else y.to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = scale.contiguous().view(storage)  # [..., 4]: the float32's bytes
    return torch.cat([codes.view(storage), scale_bytes], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_dim + 4]`` (int8 or uint8 storage) -> ``[..., head_dim]`` values in ``dtype``
    (``decode(q) * scale`` in float32, then cast)."""
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d]
    vals = codes.float() if rows.dtype == torch.int8 else codes.view(torch.float8_e4m3fn).float()
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (vals * scale).to(dtype)


def write_kv8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Quantize k, v ``[num_tokens, num_kv_heads, head_dim]`` and scatter the rows into slots ``slot_mapping``
    of 8-bit caches ``[num_blocks, block_size, num_kv_heads, head_dim + 4]``."""
    num_kv_heads, width = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, quantize(k, k_cache.dtype))
    v_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, quantize(v, v_cache.dtype))
