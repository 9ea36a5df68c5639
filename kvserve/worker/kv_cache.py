"""Sizing and allocating the physical KV cache."""

from __future__ import annotations

import torch

from kvserve.models.registry import ModelArchConfig

GiB = 1 << 30


def block_bytes(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers: ``block_size × kv_bytes_per_token``."""
    return block_size * arch.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def num_blocks_for_budget(budget_bytes: int, arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks fit ``budget_bytes`` (floor). Raises ValueError when not even one does."""
    n = budget_bytes // block_bytes(arch, block_size, dtype)
    if n < 1:
        raise ValueError(f"KV cache budget of {budget_bytes / GiB:.3f} GiB holds no block of "
                         f"{block_bytes(arch, block_size, dtype)} bytes; raise --kv-cache-memory")
    return int(n)


def allocate_kv_cache(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Zero-filled: padded attention reads masked slots, and masked garbage could be NaN (0 × NaN = NaN).
    """
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_hidden_layers)]
