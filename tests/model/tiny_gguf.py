"""Tiny random models written as GGUF files with quantized tensors (tests of ``--quantization gguf``).

The ``gguf`` package quantizes Q4_0, Q4_1, Q5_0 and Q8_0; Q4_K and Q6_K (which it only dequantizes) are quantized
here the simple way: per sub-block scale = range / levels, the super-block's f16 scale = largest / 63 (Q4_K, 6-bit
scales and mins) or / 127 (Q6_K, int8 scales), codes rounded to nearest (not llama.cpp's error-minimizing search;
the layout is the point). ``tests/model/test_gguf_weights.py`` checks them against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), dtype=np.float32), where=b > 0)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``[n, k]`` float (k a multiple of 256) -> ``[n, k / 256 * 144]`` uint8 Q4_K blocks."""
    n, k = w.shape
    b = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)  # [n, nb, 8]
    scale = (hi - lo) / 15
    d16, dmin16 = (scale.max(-1) / 63).astype(np.float16), ((-lo).max(-1) / 63).astype(np.float16)
    d, dmin = d16.astype(np.float32)[..., None], dmin16.astype(np.float32)[..., None]
    sc = np.clip(np.round(_div(scale, d)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_div(-lo, dmin)), 0, 63).astype(np.uint8)
    q = np.clip(np.round(_div(b + (dmin * m)[..., None], (d * sc)[..., None])), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, -1, 128)  # chunk p: groups 2p (low), 2p + 1 (high)
    blocks = np.concatenate([d16.view(np.uint8).reshape(n, -1, 2), dmin16.view(np.uint8).reshape(n, -1, 2),
                             scales, qs], axis=-1)
    return blocks.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[n, k]`` float (k a multiple of 256) -> ``[n, k / 256 * 210]`` uint8 Q6_K blocks."""
    n, k = w.shape
    b = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(b).max(-1) / 31  # [n, nb, 16]
    d16 = (scale.max(-1) / 127).astype(np.float16)
    d = d16.astype(np.float32)[..., None]
    sc = np.clip(np.round(_div(scale, d)), -128, 127).astype(np.int8)
    q = (np.clip(np.round(_div(b, (d * sc)[..., None])), -32, 31) + 32).astype(np.uint8)
    qe = q.reshape(n, -1, 2, 4, 32)  # half, quarter (group), element
    ql = np.concatenate([(qe[:, :, :, 0] & 15) | ((qe[:, :, :, 2] & 15) << 4),
                         (qe[:, :, :, 1] & 15) | ((qe[:, :, :, 3] & 15) << 4)], axis=-1)  # [n, nb, 2, 64]
    qh = sum(((qe[:, :, :, j] >> 4) << (2 * j)) for j in range(4)).astype(np.uint8)  # [n, nb, 2, 32]
    blocks = np.concatenate([ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8),
                             d16.view(np.uint8).reshape(n, -1, 2)], axis=-1)
    return blocks.reshape(n, -1)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """A float ``[n, k]`` tensor in ``qtype``: float32 / float16 arrays, or ``[n, row bytes]`` uint8 blocks."""
    if qtype == Q.Q4_K:
        return quantize_q4_k(w)
    if qtype == Q.Q6_K:
        return quantize_q6_k(w)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def write_tiny_gguf(path: Path, arch: str, formats: Callable[[str, int], Q], *, hidden: int, intermediate: int,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 600, tied: bool = False,
                    bias: bool = False, seed: int = 0) -> Path:
    """Write a random ``arch`` (``llama`` / ``qwen2``) model; ``formats(kind, layer)`` picks each weight's type
    (kinds: token_embd, output, attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down; layer -1 for
    token_embd / output). Norms and biases are F32. The rows are random, so llama's q/k permutation is moot."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)

    def add(name: str, kind: str, layer: int, n: int, k: int, std: float) -> None:
        qtype = formats(kind, layer)
        data = quantize(rng.normal(0, std, (n, k)), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)

    add("token_embd.weight", "token_embd", -1, vocab, hidden, 1.0)
    if not tied:
        add("output.weight", "output", -1, vocab, hidden, 0.1)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.normal(size=hidden)).astype(np.float32))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate)}
    for i in range(layers):
        for kind, (n, k) in shapes.items():
            add(f"blk.{i}.{kind}.weight", kind, i, n, k, 1.5 / np.sqrt(k))
            if bias and kind in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{i}.{kind}.bias", rng.normal(0, 0.5, n).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.normal(size=hidden)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
