"""Host memory for the weights and the KV cache on CPU: transparent huge pages (Linux).

A decode step streams every weight once. With the usual 4 KiB pages a 269 MB model spans ~66,000 pages,
far more than the TLB holds, so the stream takes a page walk every 4 KiB and one core read ~15 GB/s of a
~25 GB/s machine (Zen 4, measured with ``small_gemm`` at M = 1; docs/performance-log.md). Backed by 2 MiB
transparent huge pages the same kernel reads at ~25 GB/s. torch's CPU allocator asks for huge pages only
when ``THP_MEM_ALLOC_ENABLE=1`` was set before its first allocation, which a library cannot ensure; so
kvserve maps the memory itself: a private anonymous ``mmap`` aligned to 2 MiB and marked
``MADV_HUGEPAGE`` (the kernel backs it with huge pages on first touch when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``), viewed as a tensor.

``KVSERVE_HUGEPAGES=0`` turns it off (plain torch allocations); it is off on non-CPU devices and where the
platform has no ``MADV_HUGEPAGE``.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 64  # bytes: each tensor of a packed region starts on a cache line


def hugepages_enabled(device: torch.device) -> bool:
    """True when CPU tensors for ``device`` are placed in transparent huge pages (see the module doc)."""
    return (device.type == "cpu" and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("KVSERVE_HUGEPAGES", "1") != "0")


def empty_hugepages(nbytes: int) -> torch.Tensor:
    """A zero-filled ``[nbytes]`` uint8 CPU tensor on 2 MiB-aligned memory advised for huge pages.

    The mapping lives as long as the tensor (or any view of it). Raises OSError when the mapping fails.
    """
    mm = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # THP compiled out or disabled: still valid memory, just 4 KiB pages
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", exc)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    offset = (-buf.data_ptr()) % HUGE_PAGE
    return buf[offset:offset + nbytes]


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (same shapes, dtypes, values; contiguous) inside one huge-page region."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    region = empty_hugepages(sum(_aligned(s) for s in sizes))
    out, offset = [], 0
    for t, size in zip(tensors, sizes, strict=True):
        view = region[offset:offset + size].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        offset += _aligned(size)
    return out


def move_parameters_to_hugepages(model: nn.Module) -> int:
    """Re-home every parameter of ``model`` (each shared parameter once), then every buffer (int8 weights
    live in buffers, ``layers/int8.py``), into one huge-page region.

    Returns the bytes moved (0 when nothing was moved: huge pages disabled, or a tensor not on CPU).
    The tensors keep their identity (``.data`` is replaced), so tied weights stay tied.
    """
    params = list(model.parameters()) + list(model.buffers())
    if not params or not all(hugepages_enabled(p.device) for p in params):
        return 0
    with torch.no_grad():
        for p, packed in zip(params, pack_tensors([p.detach() for p in params]), strict=True):
            p.data = packed
    moved = sum(p.numel() * p.element_size() for p in params)
    logger.info("weights: %.1f MiB in transparent huge pages", moved / (1 << 20))
    return moved
