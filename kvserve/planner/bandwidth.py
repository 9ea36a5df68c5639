"""A quick measurement of this machine's memory bandwidth (for ``kvserve plan`` when none is given).

``numpy.copyto`` of a ``size_mib`` array, best of ``repeats``: a copy reads N bytes and writes N bytes.
* memory bandwidth (roofline, bytes/s) = 2 N / t, the STREAM "copy" convention;
* copy bandwidth (swap, bytes/s) = N / t: how fast a block's bytes move from one buffer to another.
The array is larger than any cache so that DRAM is measured; the numbers are rough on a busy machine.
"""

from __future__ import annotations

import time
from typing import NamedTuple


class Bandwidth(NamedTuple):
    """Bytes per second: ``memory`` (read + write traffic) and ``copy`` (bytes copied)."""

    memory: float
    copy: float


def measure_bandwidth(size_mib: int = 128, repeats: int = 3) -> Bandwidth:
    """Measure with a numpy copy of ``size_mib`` MiB, the best of ``repeats`` (seconds-scale: ~0.1 s each).

    Raises:
        ValueError: ``size_mib`` or ``repeats`` < 1.
    """
    if size_mib < 1 or repeats < 1:
        raise ValueError(f"size_mib and repeats must be >= 1, got {size_mib}, {repeats}")
    import numpy as np

    n = size_mib << 20
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages once
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return Bandwidth(memory=2 * n / best, copy=n / best)
