"""Tensor-parallel sharding of a Llama-family checkpoint (Megatron-LM's split, as vLLM's):

    qkv_proj, gate_up_proj   column-parallel: rank r holds its heads' q, k, v rows / its slice of the MLP
    o_proj, down_proj        row-parallel: rank r holds the matching input columns; partial sums all-reduced
    embed_tokens, lm_head    vocabulary-parallel: rank r holds rows [r × shard, (r + 1) × shard) of the vocabulary
    norms                    replicated

E.g. Qwen2.5-Coder-0.5B (14 query heads, 2 KV heads of 64, MLP 4,864, vocabulary 151,936) at size 2: each rank
holds 7 query heads and 1 KV head (q rows 448, k and v rows 64 each), 2,432 MLP columns, 75,968 vocabulary
rows, and a KV cache of its one KV head.
"""

from __future__ import annotations

import dataclasses

import torch

from kvserve.errors import InvalidRequestError
from kvserve.models.registry import ModelArchConfig


def vocab_shard_size(vocab_size: int, size: int) -> int:
    """Rows of the vocabulary each rank holds: ``ceil(vocab_size / size)`` (the last shard is zero-padded, so
    that every rank's shard, and its slice of the gathered logits, has the same shape)."""
    return -(-vocab_size // size)


def shard_arch(arch: ModelArchConfig, size: int) -> ModelArchConfig:
    """The shape one rank of ``size`` computes: ``size``-th of the query heads, KV heads and MLP width (head_dim,
    hidden size and vocabulary unchanged; the vocabulary's split is ``vocab_shard_size``'s).

    Raises:
        InvalidRequestError: ``size`` < 1, or it does not divide the query heads, the KV heads (vLLM would
            replicate KV heads when ``size`` exceeds them; kvserve refuses) or the MLP width (``param``
            ``tensor_parallel_size``).
    """
    if size < 1:
        raise InvalidRequestError(f"tensor_parallel_size: must be >= 1, got {size}", param="tensor_parallel_size")
    for what, n in (("attention (query) heads", arch.num_attention_heads),
                    ("KV heads", arch.num_key_value_heads), ("MLP intermediate size", arch.intermediate_size)):
        if n % size:
            raise InvalidRequestError(
                f"tensor_parallel_size: {size} does not divide the model's {n} {what} (it has "
                f"{arch.num_attention_heads} query and {arch.num_key_value_heads} KV heads); each rank must hold "
                f"whole heads: use a size that divides both", param="tensor_parallel_size")
    return dataclasses.replace(arch, num_attention_heads=arch.num_attention_heads // size,
                               num_key_value_heads=arch.num_key_value_heads // size,
                               intermediate_size=arch.intermediate_size // size)


def shard_weights(weights: dict[str, torch.Tensor], arch: ModelArchConfig, rank: int,
                  size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slices of the HF-named checkpoint tensors of the whole model ``arch`` (views where a slice
    is contiguous in rows; the padded vocabulary shards are new tensors). Names the model does not load pass
    through unchanged.

    Raises:
        InvalidRequestError: as ``shard_arch``.
    """
    local = shard_arch(arch, size)
    d = arch.head_dim
    q = local.num_attention_heads * d  # this rank's q rows (and o_proj's input columns)
    kv = local.num_key_value_heads * d
    mlp = local.intermediate_size
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    cols = {"o_proj": q, "down_proj": mlp}
    shard = vocab_shard_size(arch.vocab_size, size)
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(t, rank * shard, shard)
        elif proj in rows:  # weight [out, in] or bias [out]: this rank's output rows
            n = rows[proj]
            out[name] = t[rank * n:(rank + 1) * n]
        elif proj in cols and name.endswith(".weight"):  # weight [out, in]: this rank's input columns
            n = cols[proj]
            out[name] = t[:, rank * n:(rank + 1) * n]
        else:
            out[name] = t
    return out


def _vocab_rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows ``[start, start + n)`` of ``t`` ``[vocab, hidden]``, zero rows past its end."""
    part = t[start:start + n]
    if part.shape[0] == n:
        return part
    padded = torch.zeros((n, *t.shape[1:]), dtype=t.dtype)
    padded[:part.shape[0]] = part
    return padded
