"""A tensor-parallel worker: ranks 1..N-1, each in its own process (``multiproc.py``) or Ray actor
(``ray_executor.py``), running the same ``ModelRunner`` as rank 0 on its shard of the model.

Protocol over one ``multiprocessing.connection.Connection`` to rank 0 (pickled tuples)::

    worker                                   rank 0 (the engine process)
    ("hello", rank, pid)         ──▶
                                             both join the process group (gloo / NCCL)
    ("ready", num_blocks)        ──▶         the KV blocks this rank's budget holds (rank 0 takes the minimum)
                                 ◀──         ("init", num_blocks, num_host_blocks)
    ("ok", None)                 ──▶
                                 ◀──         ("step", WorkerStep)               each step; no answer
                                 ◀──         ("measure_prefill_speed", tokens)  answered ("ok", tokens/s)
                                 ◀──         ("shutdown",)
    ("error", text)              ──▶         on any failure, then the worker exits (its collectives then fail)

A worker exits when the connection closes (rank 0's process is gone) or a collective fails (a rank died).
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection

import torch

from kvserve.config import EngineConfig
from kvserve.distributed.tp_group import TPGroup, destroy_tp_group, init_tp_group
from kvserve.executor.worker_step import StepDecoder
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_weights
from kvserve.models.tp_shard import shard_arch
from kvserve.worker.kv_cache import num_device_blocks
from kvserve.worker.model_runner import ModelRunner, build_model

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything a worker needs to start (picklable; the dtypes as rank 0 resolved them, so that every rank
    computes alike).

    Attributes:
        config: the engine configuration (``max_num_batched_tokens`` resolved).
        rank, size: this worker's rank and the tensor-parallel size.
        master_addr, master_port: the process group's rendezvous (rank 0's TCP store).
        device: this rank's device (``cpu``, ``cuda:1``, ...).
        dtype, compute_dtype, kv_dtype: weights, activations and KV cache, as rank 0 resolved them.
        max_model_len: the longest sequence (the rotary table's length).
        threads: torch threads of this rank (``--num-threads``).
        cpus: the CPUs to pin this rank to (None: not pinned).
        address, authkey: where to connect to rank 0 (Ray actors; mp workers get their end of a pipe instead).
    """

    config: EngineConfig
    rank: int
    size: int
    master_addr: str
    master_port: int
    device: str
    dtype: torch.dtype
    compute_dtype: torch.dtype
    kv_dtype: torch.dtype
    max_model_len: int
    threads: int
    cpus: set[int] | None = None
    address: tuple[str, int] | None = None
    authkey: bytes = field(default=b"", repr=False)


def run_worker(spec: WorkerSpec, conn: Connection | None = None) -> None:
    """A worker's whole life: connect, join the group, load the shard, serve steps until told to stop or until
    rank 0 is gone. Any failure is sent to rank 0 as ``("error", text)`` before the process exits with code 1.

    Args:
        conn: the connection to rank 0 (mp); None: connect to ``spec.address`` (Ray).
    """
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s tp-rank{spec.rank} %(name)s: %(message)s")
    try:
        if conn is None:
            assert spec.address is not None
            conn = Client(spec.address, authkey=spec.authkey)
        if spec.cpus is not None:
            os.sched_setaffinity(0, spec.cpus)  # before the OpenMP team exists: its threads inherit it
        torch.set_num_threads(spec.threads)
        conn.send(("hello", spec.rank, os.getpid()))
        device = torch.device(spec.device)
        group = init_tp_group(spec.rank, spec.size, spec.master_addr, spec.master_port, device)
        runner = _build_runner(spec, group, conn)
        _serve(runner, conn)
    except (EOFError, ConnectionError):
        logger.info("rank 0 is gone; exiting")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then the process ends
        text = f"tensor-parallel rank {spec.rank} (pid {os.getpid()}): {type(e).__name__}: {e}"
        logger.error("%s\n%s", text, traceback.format_exc())
        try:
            if conn is not None:
                conn.send(("error", text))
        except OSError:
            pass
        os._exit(1)  # (no interpreter teardown: a process group whose peer died may hang in it)
    destroy_tp_group()


def _build_runner(spec: WorkerSpec, group: TPGroup, conn: Connection) -> ModelRunner:
    """Load this rank's shard, report its KV block budget, and build the runner with the blocks rank 0 chose."""
    config = spec.config
    assert config.max_num_batched_tokens is not None
    device = torch.device(spec.device)
    arch, weights = load_weights(resolve_model_path(config.model))
    model = build_model(arch, weights, spec.max_model_len, spec.dtype, device, spec.compute_dtype, tp=group)
    del weights
    candidate = num_device_blocks(config, shard_arch(arch, spec.size), spec.kv_dtype, spec.dtype, device,
                                  max(config.max_num_batched_tokens, config.burst_batched_tokens or 0))
    conn.send(("ready", candidate))
    kind, num_blocks, num_host_blocks = conn.recv()
    assert kind == "init", kind
    runner = ModelRunner(model, num_blocks, config.block_size, device, num_host_blocks, kv_dtype=spec.kv_dtype)
    conn.send(("ok", None))
    return runner


def _serve(runner: ModelRunner, conn: Connection) -> None:
    """Run rank 0's messages until ``shutdown``; EOFError when rank 0's end closed."""
    decoder = StepDecoder()
    while True:
        msg = pickle.loads(conn.recv_bytes())
        kind = msg[0]
        if kind == "step":
            runner.execute_model(decoder.decode(msg[1]))
        elif kind == "measure_prefill_speed":
            conn.send(("ok", runner.measure_prefill_speed(msg[1])))
        elif kind == "shutdown":
            return
        else:
            raise ValueError(f"unknown message {kind!r} from rank 0")
