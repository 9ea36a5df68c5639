"""The tensor-parallel process group of one rank: the collectives the sharded model calls, and the start-up
helpers (the rendezvous store, each rank's CPUs).

gloo on CPU, NCCL on CUDA, both over ``torch.distributed``; the rendezvous is rank 0's TCP store on 127.0.0.1, on
a port the OS picks. On CPU the per-layer all-reduces and the LM head's gather go through a shared-memory segment
instead (``shm_comm.py``: 1.2-2 ms per gloo all-reduce on a 2-vCPU host, microseconds there).

Every rank holds identical activations between layers: a
row-parallel projection's partial sums are all-reduced (summed) in place, and the vocabulary-parallel LM head's
shards are gathered on rank 0, the only rank that samples.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.distributed.shm_comm import ShmComm

# Longest wait of one collective for a rank that neither answers nor dies (a dead rank closes its sockets and
# fails the collective at once). Between two collectives a rank computes one layer, so this only has to exceed
# a layer of the longest prefill chunk on the slowest host.
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass
class TPGroup:
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank: this rank, 0 .. size - 1; rank 0 schedules and samples (the driver).
        size: the tensor-parallel size.
        device: this rank's device (``cuda:rank`` on CUDA).
        shm: the shared-memory collectives (CPU ranks on one host), or None: gloo / NCCL only.
    """

    rank: int
    size: int
    device: torch.device
    shm: ShmComm | None = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same sum); returns ``x``.

        Raises:
            RuntimeError: a rank died (its connection closed) or did not answer within ``COLLECTIVE_TIMEOUT_S``.
        """
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_reduce(x)
        dist.all_reduce(x)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` ``[rows, n]`` (same shape on all ranks), concatenated on rank 0 along the last dim:
        ``[rows, size * n]`` on rank 0, None elsewhere.

        Raises:
            RuntimeError: as ``all_reduce``.
        """
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return self.shm.gather_to_driver(x)
        if not self.is_driver:
            dist.gather(x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV blocks that fit), on every rank."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def create_store(host: str, size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on ``host`` at a port the OS picks (``store.port``), before any other
    rank starts: a rank that connects early would otherwise back off its retries for up to minutes."""
    return dist.TCPStore(host, 0, size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_tp_group(rank: int, size: int, master_addr: str, master_port: int, device: torch.device,
                  store: dist.Store | None = None, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TPGroup:
    """Join the default process group (gloo on CPU, NCCL on CUDA) as ``rank`` of ``size``; blocks until every
    rank joined.

    Args:
        store: rank 0's own store (``create_store``); other ranks connect to ``master_addr:master_port``.
        timeout_s: the longest a collective waits for a rank (``COLLECTIVE_TIMEOUT_S``).
    Raises:
        RuntimeError / DistStoreError: a rank did not join within ``timeout_s``.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:  # NOTE: a store object on every rank (init_method would prefix the keys rank 0's lacks)
        store = dist.TCPStore(master_addr, master_port, size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    shm = ShmComm.connect(rank, size, store, timeout_s) if device.type == "cpu" else None
    return TPGroup(rank, size, device, shm)


def destroy_tp_group() -> None:
    """Leave the process group (no-op when none); safe after a rank died."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_cpus(size: int, threads: int, allowed: set[int] | None = None) -> list[set[int]] | None:
    """The CPUs each rank is pinned to: rank ``r`` gets the ``r``-th run of ``threads`` CPUs of ``allowed``
    (default: this process's affinity), so ranks never share a core; None when ``size × threads`` exceeds the
    CPUs (then nothing is pinned and the OS places the threads).

    E.g. ``size=2, threads=2, allowed={0..7}`` -> ``[{0, 1}, {2, 3}]``.
    """
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if size * threads > len(cpus):
        return None
    return [set(cpus[r * threads:(r + 1) * threads]) for r in range(size)]
