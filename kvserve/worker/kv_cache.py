"""Sizing and allocating the physical KV cache.

Caches of a logical KV dtype ``kv_dtype`` (float32, bfloat16, or the 8-bit ``int8`` / ``float8_e4m3fn``) are
tensors of ``storage_dtype(kv_dtype)`` shaped ``[num_blocks, block_size, num_kv_heads, row_elems]``, where a
row is ``head_dim`` elements, or for 8 bits ``head_dim`` codes plus their scales: int8 a 2-byte float16 per 16
channels, fp8 one 4-byte float32 (``layers/kv_quant.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.layers.kv_quant import kv_bytes_per_token, row_elems, storage_dtype
from kvserve.models.registry import ModelArchConfig
from kvserve.worker.host_memory import hugepages_enabled, pack_tensors

if TYPE_CHECKING:
    from kvserve.config import EngineConfig

GiB = 1 << 30


def block_bytes(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers, scales included: ``block_size × kv_bytes_per_token``, i.e.
    ``block_size × 2 × layers × kv_heads × head_dim × element_size`` for float32 / bfloat16 and
    ``block_size × 2 × layers × kv_heads × row_elems`` for int8 (``head_dim + 2 ceil(head_dim / 16)``) / fp8
    (``head_dim + 4``) (SmolLM2, 16-token blocks: bfloat16 368,640 bytes, int8 207,360, fp8 195,840: 1.78× the
    blocks with int8 at any head_dim a multiple of 16, 1.88× with fp8 at head_dim 64, 1.94× at 128)."""
    return block_size * kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, dtype)


def num_blocks_for_budget(budget_bytes: int, arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks fit ``budget_bytes`` (floor). Raises ValueError when not even one does."""
    n = budget_bytes // block_bytes(arch, block_size, dtype)
    if n < 1:
        raise ValueError(f"KV cache budget of {budget_bytes / GiB:.3f} GiB holds no block of "
                         f"{block_bytes(arch, block_size, dtype)} bytes; raise --kv-cache-memory")
    return int(n)


def allocate_kv_cache(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each ``[num_blocks, block_size, num_kv_heads, row_elems]`` of the storage
    dtype (see the module docstring; 8-bit: zero codes with zero scales).

    Zero-filled: padded attention reads masked slots, and masked garbage could be NaN (0 × NaN = NaN).
    On CPU the caches lie in transparent huge pages (``host_memory``).
    """
    shape = (num_blocks, block_size, arch.num_key_value_heads, row_elems(arch.head_dim, dtype))
    dtype = storage_dtype(dtype)
    if hugepages_enabled(device):  # decode attention streams the cache: huge pages, as the weights
        n = arch.num_hidden_layers
        caches = pack_tensors([torch.zeros((), dtype=dtype).expand(shape)] * (2 * n))
        return [(caches[2 * i], caches[2 * i + 1]) for i in range(n)]
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_hidden_layers)]


def num_device_blocks(config: EngineConfig, arch: ModelArchConfig, kv_dtype: torch.dtype, dtype: torch.dtype,
                      device: torch.device, max_num_batched_tokens: int, kv_share: float = 1.0) -> int:
    """KV blocks of ``arch`` (under tensor parallelism: one rank's shard) that this device's budget holds.

    ``--num-gpu-blocks-override`` when given; on CUDA ``--gpu-memory-utilization`` of the device less what is
    allocated and a reserve for one step's activations (8 × tokens × intermediate × dtype bytes); on CPU
    ``--kv-cache-memory`` GiB (per rank). ``kv_share``: the target model's share of the KV bytes (a draft model's
    cache takes the rest).

    Raises:
        ValueError: the budget holds no block.
    """
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - torch.cuda.memory_allocated(device)
        budget -= 8 * max_num_batched_tokens * arch.intermediate_size * dtype.itemsize
        budget = min(budget, free)
    else:
        budget = int(config.kv_cache_memory * GiB)
    return num_blocks_for_budget(int(budget * kv_share), arch, config.block_size, kv_dtype)


def num_host_blocks_for(swap_space_gib: float, arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """How many KV blocks ``swap_space_gib`` GiB of host memory holds (floor; 0 when it is 0).

    Same block geometry as the device cache, so one host block holds exactly one device block.
    Raises ValueError for a negative size.
    """
    if swap_space_gib < 0:
        raise ValueError(f"swap_space must be >= 0 GiB, got {swap_space_gib}")
    return int(int(swap_space_gib * GiB) // block_bytes(arch, block_size, dtype))


def allocate_host_swap_pool(arch: ModelArchConfig, num_host_blocks: int, block_size: int, dtype: torch.dtype,
                            device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v) host tensors ``[num_host_blocks, block_size, num_kv_heads, row_elems]`` (the device
    cache's storage dtype and row layout, scales included) for swapped blocks.

    Always on CPU; pinned (page-locked) when ``device`` is CUDA so copies can be asynchronous DMA.
    ``torch.empty``, not zeros: a block is only ever read back after it was written by a swap-out, and
    untouched pages of a multi-GiB pool then cost no memory. On a CPU device this is simply a second pool
    in the same RAM. Empty list when ``num_host_blocks`` is 0.
    """
    if num_host_blocks <= 0:
        return []
    shape = (num_host_blocks, block_size, arch.num_key_value_heads, row_elems(arch.head_dim, dtype))
    dtype = storage_dtype(dtype)
    pin = device.type == "cuda"
    return [(torch.empty(shape, dtype=dtype, pin_memory=pin), torch.empty(shape, dtype=dtype, pin_memory=pin))
            for _ in range(arch.num_hidden_layers)]
