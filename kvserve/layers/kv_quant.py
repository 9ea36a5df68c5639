"""8-bit KV cache: the row layouts, quantization on write and dequantization on read (the torch reference).

Two formats, named as vLLM's ``--kv-cache-dtype`` values:

* ``int8``: symmetric int8 with a scale per group of 16 consecutive channels (``INT8_GROUP``):
  ``scale = amax / 127`` of the group, computed in float32 and rounded *up* to float16; ``q = round(x / scale)``
  against that float16 scale;
* ``fp8`` (= ``fp8_e4m3``): ``torch.float8_e4m3fn`` codes, ``scale = amax / 448`` per token and KV head (one
  float32 scale per row), so the largest value of a row maps to e4m3's largest finite value and nothing
  saturates.

A row, one (token, KV head) of K or V, is its ``head_dim`` (D) 8-bit codes followed by its scales::

    int8 (G = ceil(D / 16) groups; the last one shorter when 16 does not divide D):
    byte  0 ........................ D-1 | D, D+1 | D+2, D+3 | ... | D+2G-2, D+2G-1
          q[0]  q[1]  ...  q[D-1]         | s[0]    | s[1]     | ... | s[G-1]        (float16, native order)
    x[d] ~= q[d] * s[d // 16]                   D = 64: 64 + 8 = 72 bytes; D = 128: 128 + 16 = 144

    fp8:
    byte  0 ........................ D-1 | D ... D+3
          q[0]  q[1]  ...  q[D-1]         | scale (float32, native byte order)
    x[d] ~= e4m3(q[d]) * scale                  D = 64: 68 bytes; D = 128: 132

so a cache is ``[num_blocks, block_size, num_kv_heads, row_elems(head_dim, kv_dtype)]`` bytes: a block (and a
payload of the offload tiers or the PD transfer, a swap, a copy-on-write) carries its scales with its codes,
and a block copy needs no knowledge of the format. The storage dtype names the format: ``torch.int8`` for
int8, ``torch.uint8`` for fp8 (raw e4m3fn bytes; torch has no CPU ``index_copy_`` for ``float8_e4m3fn``).
The engine's logical KV dtype is ``torch.int8`` or ``torch.float8_e4m3fn``; ``storage_dtype`` maps it.

Why groups of 16 for int8 (docs/kv_cache_8bit.md): one scale per row let a few large channels set the step
of all 64 and the greedy tokens of SmolLM2-135M left the fp32 cache's at 0.61 of the tokens on average;
groups of 16 reach 0.97. The int8 scale is a float16 rounded up, so ``|x / scale| <= 127`` holds without
clamping (round to nearest could put the group's largest element at 127.06, or at 178 among float16's
subnormals); every positive amax gets a positive scale (at least 2^-24, float16's smallest subnormal), and an
amax over ``127 × 65504`` gets float16's largest finite scale, 65504, with its codes clamped to +-127 (the
group saturates at +-8.3e6 instead of overflowing to an infinite scale). fp8 keeps its per-row scale: e4m3's
3 mantissa bits bound its error, and groups did not improve it.

The attention paths read rows directly: the torch path dequantizes only the blocks it gathers
(``dequantize``), the native kernels dequantize in registers or L1 tiles (``csrc/kv8.h``).
"""

from __future__ import annotations

import torch

INT8_GROUP = 16  # channels per int8 scale
INT8_SCALE_BYTES = 2  # one float16 per group
FP8_SCALE_BYTES = 4  # one float32 per row
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
F16_MAX = 65504.0  # largest finite float16: the int8 scale's ceiling

# --kv-cache-dtype spelling -> the engine's logical KV dtype
KV8_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn,
                                      "fp8_e4m3": torch.float8_e4m3fn}

_STORAGE = {torch.int8: torch.int8, torch.float8_e4m3fn: torch.uint8}


def storage_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache tensors for a logical KV dtype (8-bit: int8 or uint8 bytes; others: itself)."""
    return _STORAGE.get(kv_dtype, kv_dtype)


def is_kv8(dtype: torch.dtype) -> bool:
    """True for an 8-bit KV dtype, logical (``int8``, ``float8_e4m3fn``) or storage (``int8``, ``uint8``)."""
    return dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn)


def int8_groups(head_dim: int) -> int:
    """Scale groups of an int8 row: ``ceil(head_dim / 16)``."""
    return -(-head_dim // INT8_GROUP)


def scale_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of a row's scales: ``2 × ceil(head_dim / 16)`` for int8, 4 for fp8 (logical or storage dtype).

    Raises:
        ValueError: not an 8-bit dtype.
    """
    if kv_dtype == torch.int8:
        return INT8_SCALE_BYTES * int8_groups(head_dim)
    if kv_dtype in (torch.uint8, torch.float8_e4m3fn):
        return FP8_SCALE_BYTES
    raise ValueError(f"{kv_dtype} is not an 8-bit KV dtype")


def row_elems(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (token, KV head) row: ``head_dim``, plus the scale bytes for an 8-bit dtype
    (int8: ``head_dim + 2 × ceil(head_dim / 16)``, 72 at head_dim 64; fp8: ``head_dim + 4``, 68)."""
    return head_dim + scale_bytes(head_dim, kv_dtype) if is_kv8(kv_dtype) else head_dim


def kv8_head_dim(width: int, storage: torch.dtype) -> int:
    """The head_dim of 8-bit rows ``width`` bytes wide (the inverse of ``row_elems``).

    Raises:
        ValueError: no head_dim gives rows of this width in this format.
    """
    if storage == torch.int8:
        head_dim = width - INT8_SCALE_BYTES * -(-width // (INT8_GROUP + INT8_SCALE_BYTES))
    else:
        head_dim = width - scale_bytes(1, storage)
    if head_dim < 1 or row_elems(head_dim, storage) != width:
        raise ValueError(f"no {storage} KV row is {width} bytes wide")
    return head_dim


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """KV bytes of one token over all layers, scales included:
    ``2 (K, V) × layers × kv_heads × row_elems × element_size``; int8: ``2 L H (D + 2 ceil(D / 16))``, fp8:
    ``2 L H (D + 4)``."""
    itemsize = torch.empty((), dtype=storage_dtype(kv_dtype)).element_size()
    return 2 * num_layers * num_kv_heads * row_elems(head_dim, kv_dtype) * itemsize


def layout_tag(kv_dtype: torch.dtype) -> str | None:
    """A name of the 8-bit row layout that changed since the first 8-bit format (mixed into the model
    fingerprint, so blocks of the per-row int8 layout, e.g. in a shared offload tier, are never read as the
    grouped one: at head_dim 17-32 both rows are equally wide); None for the other dtypes."""
    return "int8 codes, float16 scale per 16 channels" if kv_dtype == torch.int8 else None


def format_code(cache: torch.Tensor) -> int:
    """The native kernels' format flag of a cache tensor: 0 float32, 1 bfloat16, 2 int8, 3 fp8 (uint8 bytes).

    Raises:
        TypeError: any other dtype.
    """
    codes = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}
    if cache.dtype not in codes:
        raise TypeError(f"no native KV format for {cache.dtype}")
    return codes[cache.dtype]


def int8_scales(amax: torch.Tensor) -> torch.Tensor:
    """float16 int8 scales of groups with maxima ``amax`` (float32, >= 0): the smallest float16 >= ``amax / 127``,
    capped at 65504 (float16's largest finite value); 1 where ``amax`` is 0. Same shape as ``amax``."""
    s = (amax / INT8_MAX).clamp_(max=F16_MAX)
    h = s.half()  # round to nearest even, then up by one float16 step where that fell below s
    h = torch.where(h.float() < s, (h.view(torch.int16) + 1).view(torch.float16), h)
    return torch.where(amax > 0, h, torch.ones_like(h))


def quantize(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_dim]`` (any float dtype) -> ``[..., row_elems(head_dim, storage)]`` of ``storage``
    (``torch.int8``: int8 layout; ``torch.uint8``: fp8).

    int8: per group of 16 channels (the last one shorter when 16 does not divide head_dim), ``amax`` in float32
    and the scale ``int8_scales(amax)``; codes ``round(x / scale)`` (half to even) with ``scale`` the float16
    value, clamped to +-127 (reached only by a group over ``127 × 65504``). An all-zero group gets scale 1 and
    codes 0.
    fp8: the scale is ``amax / 448`` of each row in float32 (1 for an all-zero row); codes ``x / scale``
    clamped to +-448 and rounded to nearest-even e4m3fn.
    """
    x32 = x.float()
    if storage == torch.int8:
        d = x.shape[-1]
        groups = int8_groups(d)
        padded = torch.nn.functional.pad(x32, (0, groups * INT8_GROUP - d)) if d % INT8_GROUP else x32
        xg = padded.reshape(*x.shape[:-1], groups, INT8_GROUP)
        scales = int8_scales(xg.abs().amax(dim=-1))  # [..., groups] float16
        y = (xg / scales.float().unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).round_()
        codes = y.reshape(*x.shape[:-1], groups * INT8_GROUP)[..., :d].to(torch.int8)
        return torch.cat([codes, scales.contiguous().view(torch.int8)], dim=-1)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [..., 1]
    y = (x32 / scale).clamp_(-FP8_MAX, FP8_MAX)
    codes8 = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes8, scale.contiguous().view(torch.uint8)], dim=-1)  # [..., 4]: the float32's bytes


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """8-bit rows ``[..., row_elems(head_dim, storage)]`` (int8 or uint8 storage) -> ``[..., head_dim]`` values
    in ``dtype``: ``code × scale`` in float32 (exact: an int8 code times a float16 scale, or an e4m3 value times
    the float32 scale, rounded once), then cast.

    Raises:
        ValueError: the row width fits no head_dim of the format.
    """
    d = kv8_head_dim(rows.shape[-1], rows.dtype)
    codes = rows[..., :d]
    if rows.dtype == torch.int8:
        scales = rows[..., d:].contiguous().view(torch.float16).float()  # [..., groups]
        scale = scales.repeat_interleave(INT8_GROUP, dim=-1)[..., :d]
        return (codes.float() * scale).to(dtype)
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (codes.view(torch.float8_e4m3fn).float() * scale).to(dtype)


def write_kv8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """Quantize k, v ``[num_tokens, num_kv_heads, head_dim]`` and scatter the rows into slots ``slot_mapping``
    of 8-bit caches ``[num_blocks, block_size, num_kv_heads, row_elems(head_dim, storage)]``."""
    num_kv_heads, width = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, quantize(k, k_cache.dtype))
    v_cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, quantize(v, v_cache.dtype))
