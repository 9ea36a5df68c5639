"""Starting the tensor-parallel ranks: each rank's spec (device, CPUs, rendezvous), then the backend's executor."""

from __future__ import annotations

import logging
import os

import torch

from kvserve.config import EngineConfig
from kvserve.distributed.tp_group import create_store, rank_cpus
from kvserve.errors import InvalidRequestError
from kvserve.executor.distributed import DistributedExecutor
from kvserve.executor.worker import WorkerSpec

logger = logging.getLogger(__name__)

MASTER_ADDR = "127.0.0.1"  # the rendezvous of a single-host group: never on an outside interface


def check_gpu_count(size: int, num_gpus: int) -> None:
    """One GPU per rank.

    Raises:
        InvalidRequestError: fewer GPUs than ``size`` (``param`` ``tensor_parallel_size``).
    """
    if num_gpus < size:
        raise InvalidRequestError(f"tensor_parallel_size: {size} ranks need {size} GPUs (one each), this host has "
                                  f"{num_gpus}", param="tensor_parallel_size")


def start_distributed_executor(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                               compute_dtype: torch.dtype, kv_dtype: torch.dtype, max_model_len: int,
                               threads: int) -> DistributedExecutor:
    """Start ranks 1..N-1 (``config.distributed_executor_backend``: ``mp`` processes, the default, or ``ray``
    actors) and join the process group with them as rank 0; they load their shards while rank 0 loads its own.

    Args:
        device: rank 0's device (``cpu`` or ``cuda:0``); rank ``r`` gets ``cuda:r`` on CUDA.
        dtype, compute_dtype, kv_dtype: as rank 0 resolved them (every rank uses them).
        threads: torch threads per rank.
    Raises:
        InvalidRequestError: fewer GPUs than ranks.
        ExecutorDeadError: a worker failed or died before joining.
    """
    size = config.tensor_parallel_size
    if device.type == "cuda":
        check_gpu_count(size, torch.cuda.device_count())
    cpus = rank_cpus(size, threads) if device.type == "cpu" else None
    if device.type == "cpu" and cpus is None:
        logger.warning("tensor parallelism: %d ranks x %d threads exceed the %d CPUs this process may use; ranks "
                       "are not pinned", size, threads, len(os.sched_getaffinity(0)))
    store = create_store(MASTER_ADDR, size)
    port = store.port

    def spec(rank: int) -> WorkerSpec:
        return WorkerSpec(config, rank, size, MASTER_ADDR, port,
                          str(torch.device("cuda", rank)) if device.type == "cuda" else "cpu", dtype, compute_dtype,
                          kv_dtype, max_model_len, threads, None if cpus is None else cpus[rank])

    workers = [spec(rank) for rank in range(1, size)]
    logger.info("tensor parallelism: %d ranks (%s backend), %d thread(s) each%s", size,
                config.distributed_executor_backend or "mp", threads,
                "" if cpus is None else ", on CPUs " + " | ".join(",".join(map(str, sorted(c))) for c in cpus))
    if config.distributed_executor_backend == "ray":
        from kvserve.executor.ray_executor import RayExecutor

        return RayExecutor(spec(0), workers, store)
    from kvserve.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(spec(0), workers, store)
