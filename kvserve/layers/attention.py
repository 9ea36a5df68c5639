"""Paged attention: K/V written through ``slot_mapping``, read through per-request block tables.

KV cache of one layer: ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.
A token at position ``p`` of a request lives in slot ``block_table[p // block_size] * block_size +
p % block_size`` of the flattened ``[num_blocks * block_size, num_kv_heads, head_dim]`` view.

A step's tokens are laid out decodes first, then prefill chunks::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 p1 p1]      3 decode requests (1 token each), 2 prefill chunks
    decode group  -> batched SDPA, query [D, kv_heads, group, head_dim] against gathered K/V
    prefill group -> one batched SDPA over padded queries [P, max_q]: causal when no chunk has a cached
                     prefix, else with a causal-with-offset mask

8-bit caches (``int8`` / ``fp8``, ``kv_quant.py``) hold rows of codes plus their scales: ``write_kv``
quantizes, the torch path dequantizes only the blocks it gathers, and the native kernels take the rows as
they are (dequantizing in registers); where the library lacks an 8-bit variant (``cpu_kernels.kv8_features``)
the call falls back to the torch path.

On CPU with the compiled kernels (float32 / bfloat16 activations and cache), every prefill chunk of the
step instead goes to one call of ``paged_prefill_attention`` (``csrc/prefill_attention.c``), which reads
K/V in place from the cache, causal with each chunk's offset, flash-attention style: ``native_prefill``
replaces the prefill groups, and the torch path above stays the reference and the fallback.

Decodes are sorted by length and split into a few buckets (at most ``MAX_DECODE_BUCKETS``), each padded
only to its own longest sequence: K/V gathering and attention are memory-bound, and padding every
request to the batch's longest would read up to ~2x the bytes. There is no Python loop over requests
or tokens. GQA: decode folds the query heads of one KV head into one matrix per request; prefill uses
SDPA's ``enable_gqa``; K/V are never repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.layers import cpu_kernels
from kvserve.layers.cpu_kernels import native_available, paged_decode_attention, paged_prefill_attention
from kvserve.layers.kv_quant import dequantize, is_kv8, write_kv8

MAX_DECODE_BUCKETS = 4
MIN_DECODE_BUCKET = 8  # requests; smaller buckets cost more in per-call overhead than padding saves


@dataclass
class PrefillGroup:
    """P prefill chunks attended in one SDPA call over padded queries.

    Attributes:
        start, end: the group's tokens are ``[start, end)`` of the step.
        block_tables: ``[P, max_blocks]`` int64.
        pad_index: ``[end - start]`` int64 position of each token in the padded ``[P * max_q]`` layout.
        max_q: longest chunk in tokens.
        mask: ``[P, 1, max_q, max_blocks * block_size]`` float32 additive mask (0 or -inf) when some chunk
            continues a cached prefix; None when every chunk starts at position 0 (plain causal).
        bounds: for fresh prompts (mask None), each prompt's ``(start, end)`` tokens of the step: they are
            attended one SDPA call each, unpadded (padding P prompts to the longest costs up to ~3x the
            causal work of uniformly mixed lengths, and attention is about a third of a bf16 prefill).
    """

    start: int
    end: int
    block_tables: torch.Tensor
    pad_index: torch.Tensor
    max_q: int
    mask: torch.Tensor | None
    bounds: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class NativePrefill:
    """Every prefill chunk of a step, for the compiled kernel (``cpu_kernels.paged_prefill_attention``).

    Attributes:
        start, end: the chunks' tokens are ``[start, end)`` of the step (after the decodes).
        block_tables: ``[P, max_blocks]`` int64, one row per chunk.
        q_start: ``[P]`` int64 first token of each chunk, relative to ``start``.
        q_len: ``[P]`` int64 tokens of each chunk.
        offsets: ``[P]`` int64 tokens each request had in the cache before the chunk (0: a fresh prompt);
            query ``i`` of a chunk is at position ``offsets + i`` and attends keys ``0 .. offsets + i``.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    q_start: torch.Tensor
    q_len: torch.Tensor
    offsets: torch.Tensor


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the model runner and shared by every layer.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64 cache slot of each token of the step.
        num_decode_tokens: D; the first D tokens are decodes (one per request), sorted by length.
        decode_buckets: ``(start, end, block_tables, mask)`` per bucket of decodes ``[start, end)``:
            block_tables ``[end - start, max_blocks]`` int64 (padding entries point at any valid block),
            mask ``[end - start, 1, 1, max_blocks * block_size]`` bool, True where a key is attended.
        native_decode: instead of buckets, ``(block_tables [D, max_blocks], seq_lens [D])`` int64 for the
            compiled CPU kernel (float32 or bfloat16 caches on CPU; see ``cpu_kernels.py``).
        prefill_groups: prefill chunks, at most two groups: chunks that continue a cached prefix (masked)
            and fresh prompts (causal). See ``PrefillGroup``.
        native_prefill: instead of prefill groups, all chunks for the compiled CPU kernel (see
            ``NativePrefill``); CPU tensors, float32 / bfloat16 activations and cache.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_buckets: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    native_decode: tuple[torch.Tensor, torch.Tensor] | None = None
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    native_prefill: NativePrefill | None = None


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k, v ``[num_tokens, num_kv_heads, head_dim]`` into the cache slots ``slot_mapping`` (quantized
    for an 8-bit cache)."""
    if is_kv8(k_cache.dtype):
        write_kv8(k, v, k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, max_blocks]`` block ids -> K or V ``[B, num_kv_heads, max_blocks * block_size, head_dim]`` in
    ``dtype`` (an 8-bit cache: only these blocks are dequantized)."""
    b, nb = block_tables.shape
    _, block_size, num_kv_heads, width = cache.shape
    # index_select on the flattened table is ~2x faster than advanced indexing cache[block_tables] on CPU.
    blocks = cache.index_select(0, block_tables.reshape(-1))
    # (``.to`` is a no-op when the cache has this dtype)
    blocks = dequantize(blocks, dtype) if is_kv8(cache.dtype) else blocks.to(dtype)
    return blocks.view(b, nb * block_size, num_kv_heads, blocks.shape[-1]).transpose(1, 2)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of this step's queries over the cached K/V (this step's K/V must be written first).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` (decode tokens first).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, or for an 8-bit cache
            ``[..., row_elems(head_dim, dtype)]`` int8 / uint8 rows (``kv_quant.py``).
    Returns:
        ``[num_tokens, num_heads * head_dim]``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)
    d = meta.num_decode_tokens
    if meta.native_decode is not None and d:
        block_tables, seq_lens = meta.native_decode
        qd = q[:d].view(d, num_kv_heads, group, head_dim)
        if is_kv8(k_cache.dtype) and "decode" not in cpu_kernels.kv8_features():
            o = _decode_reference(qd, k_cache, v_cache, block_tables, seq_lens, scale)
        else:
            o = paged_decode_attention(qd, k_cache, v_cache, block_tables, seq_lens, scale)
        out[:d] = o.view(d, num_heads * head_dim)
    for start, end, block_tables, mask in meta.decode_buckets:
        k = _gather(k_cache, block_tables, q.dtype)
        v = _gather(v_cache, block_tables, q.dtype)
        qd = q[start:end].view(end - start, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.reshape(end - start, num_heads * head_dim)
    npf = meta.native_prefill
    if npf is not None and npf.end > npf.start:
        if native_prefill_supported(q, k_cache):
            paged_prefill_attention(q[npf.start:npf.end], k_cache, v_cache, npf.block_tables, npf.q_start,
                                    npf.q_len, npf.offsets, scale, out=out[npf.start:npf.end])
        else:
            _prefill_per_chunk(q, k_cache, v_cache, npf, scale, out)
    for grp in meta.prefill_groups:
        if grp.mask is None and grp.bounds:
            _fresh_prompts(q, k_cache, v_cache, grp, scale, out)
            continue
        p, max_q = grp.block_tables.shape[0], grp.max_q
        k = _gather(k_cache, grp.block_tables, q.dtype)  # [P, kv_heads, L, hd]
        v = _gather(v_cache, grp.block_tables, q.dtype)
        qp = q.new_zeros(p * max_q, num_heads, head_dim)
        qp[grp.pad_index] = q[grp.start:grp.end]
        qp = qp.view(p, max_q, num_heads, head_dim).transpose(1, 2)  # [P, num_heads, max_q, hd]
        if grp.mask is None:
            # Every chunk starts at position 0, so plain top-left causal attention is exact for every real
            # query (padded keys lie beyond it), and the kernel skips the masked tiles: ~2x less work.
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=grp.mask.to(q.dtype), scale=scale,
                                               enable_gqa=True)
        out[grp.start:grp.end] = o.transpose(1, 2).reshape(p * max_q, num_heads * head_dim)[grp.pad_index]
    return out


def _fresh_prompts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, grp: PrefillGroup, scale: float,
                   out: torch.Tensor) -> None:
    """Causal attention of each fresh prompt over its own keys (cache blocks from position 0), unpadded."""
    block_size, num_heads, head_dim = k_cache.shape[1], q.shape[1], q.shape[2]
    for i, (start, end) in enumerate(grp.bounds):
        n = end - start
        table = grp.block_tables[i:i + 1, :-(-n // block_size)]
        k = _gather(k_cache, table, q.dtype)[:, :, :n]  # [1, kv_heads, n, hd]
        v = _gather(v_cache, table, q.dtype)[:, :, :n]
        qi = q[start:end].view(1, n, num_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(1, 2).reshape(n, num_heads * head_dim)


def _decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch fallback for native decode metadata the kernel cannot take (an 8-bit cache without its native
    variant): one SDPA over the gathered (dequantized) blocks, keys past each sequence's length masked.
    q ``[D, num_kv_heads, group, head_dim]`` -> the same shape."""
    block_size = k_cache.shape[1]
    k = _gather(k_cache, block_tables, q.dtype)  # [D, kv_heads, max_blocks * block_size, hd]
    v = _gather(v_cache, block_tables, q.dtype)
    keys = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    mask = (keys[None, :] < seq_lens[:, None])[:, None, None, :]  # [D, 1, 1, L]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def native_prefill_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_prefill_attention`` takes these tensors: CPU, float32 / bfloat16 queries over a float32 /
    bfloat16 cache, or over an 8-bit cache when the library has the 8-bit prefill variant; kernels built."""
    ok = (torch.float32, torch.bfloat16)
    if not (q.device.type == "cpu" and q.dtype in ok and native_available()):
        return False
    return k_cache.dtype in ok or (is_kv8(k_cache.dtype) and "prefill" in cpu_kernels.kv8_features())


def _prefill_per_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, npf: NativePrefill,
                       scale: float, out: torch.Tensor) -> None:
    """Torch fallback for ``NativePrefill`` metadata the kernel cannot take (e.g. float16): one SDPA per
    chunk over its gathered keys, causal with the chunk's offset."""
    block_size, num_heads, head_dim = k_cache.shape[1], q.shape[1], q.shape[2]
    for i, (qs, n, c) in enumerate(zip(npf.q_start.tolist(), npf.q_len.tolist(), npf.offsets.tolist(), strict=True)):
        start = npf.start + qs
        kv_len = c + n
        table = npf.block_tables[i:i + 1, :-(-kv_len // block_size)]
        k = _gather(k_cache, table, q.dtype)[:, :, :kv_len]  # [1, kv_heads, kv_len, hd]
        v = _gather(v_cache, table, q.dtype)[:, :, :kv_len]
        qi = q[start:start + n].view(1, n, num_heads, head_dim).transpose(1, 2)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + c
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + n] = o.transpose(1, 2).reshape(n, num_heads * head_dim)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention of one request over contiguous K/V; the oracle for ``paged_attention``.

    Args:
        q: ``[q_len, num_heads, head_dim]``, the last q_len positions of the sequence.
        k, v: ``[kv_len, num_kv_heads, head_dim]`` (kv_len >= q_len).
    Returns:
        ``[q_len, num_heads * head_dim]``.
    """
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, kv_len, hd]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qq = q.transpose(0, 1)
    offset = kv_len - q_len
    mask = torch.arange(kv_len)[None, :] <= (torch.arange(q_len)[:, None] + offset)
    o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask.to(q.device), scale=scale)
    return o.transpose(0, 1).reshape(q_len, num_heads * head_dim)
