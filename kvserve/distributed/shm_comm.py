"""Same-host collectives of the tensor-parallel ranks through a shared-memory segment: the all-reduce after each
row-parallel projection and the LM head's gather, without gloo's TCP round trips.

Why: on the project's 2-vCPU host one gloo all-reduce of a decode token's 896 floats takes 1.2-2.0 ms, and a
TP = 2 decode step of Qwen2.5-Coder-0.5B makes 49 of them (2 per layer + the embedding), so the step took 122 ms
against 25 ms in one process (``benchmarks/scale_out.py --parts tp``). vLLM's CPU backend has a shared-memory
all-reduce for the same reason. Here an operation is: copy my tensor into my slot of the segment, publish the
operation's sequence number, wait until every rank published it (``csrc/shm_barrier.c``: a spinning barrier
that notices a dead peer), then read the slots. Every rank sums the slots in rank order (the same bits on every
rank; for two ranks ``a + b``, gloo's sum). Slots alternate between two halves by the sequence number's parity:
a rank overwrites the half of operation ``s`` only in operation ``s + 2``, after every rank arrived at ``s + 1``,
i.e. finished reading ``s``.

Layout of the segment (one file under /dev/shm, or the temp folder when /dev/shm has less room than the whole
segment; unlinked once every rank mapped it, so nothing outlives the processes)::

    [0, 4096)                        one int64 counter per rank, 64 bytes apart
    4096 + (p * size + r) * SLOT     rank r's slot in half p (SLOT = 16 MiB)

Tensors that are not CPU-contiguous or exceed a slot take gloo (the same decision on every rank: shapes and
dtypes agree across ranks). ``KVSERVE_TP_COMM=gloo`` turns this off; so does a missing native library (then
every rank agrees on gloo at start).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from kvserve.layers import cpu_kernels

logger = logging.getLogger(__name__)

SLOT_BYTES = 16 << 20  # per rank and half: a 512-token chunk of a 4096-wide fp32 model is 8 MiB
_HEADER = 4096
_STRIDE = 8  # int64 words between two ranks' counters (64 bytes: one cache line each)
_PATH_KEY = "kvserve/tp_shm_path"


def _free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def shm_comm_wanted() -> bool:
    """Whether this rank can and may use the shared-memory path (``KVSERVE_TP_COMM`` not ``gloo`` and the native
    library built)."""
    mode = os.environ.get("KVSERVE_TP_COMM", "shm")
    if mode not in ("shm", "gloo"):
        raise ValueError(f"KVSERVE_TP_COMM: must be shm or gloo, got {mode!r}")
    return mode == "shm" and cpu_kernels.native_available()


class ShmComm:
    """One rank's end of the segment. Build it with :meth:`connect` on every rank of an initialized gloo group.

    Attributes:
        rank, size: this rank and the group size.
        timeout_s: the longest wait for the other ranks of one operation (then RuntimeError).
    """

    def __init__(self, rank: int, size: int, mapping: mmap.mmap, pids: list[int], timeout_s: float) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._map = mapping
        self._buf = torch.frombuffer(mapping, dtype=torch.uint8)  # the whole segment, shared
        self._counters = self._buf[:_HEADER].view(torch.int64)
        self._pids = torch.tensor(pids, dtype=torch.int64)
        self._seq = 0

    @classmethod
    def connect(cls, rank: int, size: int, store: dist.Store, timeout_s: float) -> ShmComm | None:
        """Create (rank 0) or map (others) the group's segment; None on every rank when any rank cannot use it.
        A collective: every rank of the default gloo group calls it once, right after joining.

        Raises:
            RuntimeError: a rank died or did not answer within the group's timeout (gloo's error).
            OSError: the segment cannot be created or mapped.
        """
        ok = torch.tensor([1 if shm_comm_wanted() else 0], dtype=torch.int64)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok.item()):
            return None
        total = _HEADER + 2 * size * SLOT_BYTES
        if rank == 0:
            folder = Path("/dev/shm")
            if not os.access(folder, os.W_OK) or _free_bytes(folder) < total:
                # (a container's /dev/shm is often 64 MiB: touching pages past it is SIGBUS, not an error)
                folder = Path(tempfile.gettempdir())
            path = folder / f"kvserve-tp-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, total)  # sparse: pages exist once written
            store.set(_PATH_KEY, str(path))
        else:
            path = Path(store.get(_PATH_KEY).decode())
            fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        store.set(f"kvserve/tp_shm_pid/{rank}", str(os.getpid()))
        pids = [int(store.get(f"kvserve/tp_shm_pid/{r}").decode()) for r in range(size)]
        dist.barrier()  # every rank mapped it: the name can go
        if rank == 0:
            path.unlink()
        logger.info("tensor-parallel collectives through shared memory (%d ranks)", size)
        return cls(rank, size, mapping, pids, timeout_s)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can go through the segment (CPU, contiguous, at most ``SLOT_BYTES``)."""
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def _slot(self, half: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        start = _HEADER + (half * self.size + rank) * SLOT_BYTES
        n = like.numel() * like.element_size()
        return self._buf[start:start + n].view(like.dtype).view(like.shape)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``x`` and wait for every rank's; returns the ranks' slots (views) of this operation."""
        self._seq += 1
        half = self._seq & 1
        self._slot(half, self.rank, x).copy_(x)
        status = cpu_kernels.shm_arrive_wait(self._counters, self.rank, self.size, self._seq, self._pids,
                                             self.timeout_s)
        if status > 0:
            raise RuntimeError(f"tensor-parallel rank {status - 1} (pid {int(self._pids[status - 1])}) died during "
                               f"a shared-memory collective")
        if status < 0:
            raise RuntimeError(f"a shared-memory collective timed out after {self.timeout_s:g} s: a tensor-parallel "
                               f"rank did not arrive")
        return [self._slot(half, r, x) for r in range(self.size)]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (rank order: the same bits on every rank); returns ``x``.

        Raises:
            RuntimeError: a rank died or did not arrive within ``timeout_s``.
        """
        slots = self._exchange(x)
        if self.size == 1:
            return x
        torch.add(slots[0], slots[1], out=x)
        for s in slots[2:]:
            x.add_(s)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along the last dim on rank 0 (a new tensor), None elsewhere.

        Raises:
            RuntimeError: as ``all_reduce``.
        """
        slots = self._exchange(x)
        return torch.cat(slots, dim=-1) if self.rank == 0 else None
