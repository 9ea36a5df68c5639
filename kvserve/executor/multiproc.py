"""``--distributed-executor-backend mp`` (the default): ranks 1..N-1 as child processes of the engine process,
started with ``spawn`` (a fresh interpreter: no copy of the parent's threads or CUDA state), each talking to rank
0 over its end of a pipe.

The children are daemonic (Python stops them when the engine process exits normally) and also exit by
themselves when the pipe closes (the engine process died) or a collective fails. ``spawn`` hands each child the
parent's ``sys.path``, so a worker imports kvserve from wherever the engine did (a checkout or an install).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from kvserve.distributed.tp_group import init_tp_group
from kvserve.executor.distributed import _STOP_TIMEOUT_S, DistributedExecutor
from kvserve.executor.worker import WorkerSpec, run_worker

logger = logging.getLogger(__name__)


class MultiprocExecutor(DistributedExecutor):
    """Starts one process per worker rank and joins the process group with them (blocks until every rank has
    joined; ``agree_num_blocks`` then waits for their shards).

    Args:
        spec: rank 0's spec.
        store: the rendezvous store (``tp_group.create_store``), listening at ``spec.master_port``.
        worker_specs: ranks 1..N-1's.
    Raises:
        ExecutorDeadError: a worker died or failed before joining.
    """

    def __init__(self, spec: WorkerSpec, worker_specs: list[WorkerSpec], store: dist.Store) -> None:
        super().__init__(spec)
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[BaseProcess] = []
        # NOTE: one thread at a time waits for (reaps) a child: two would race in waitpid, and the loser would
        # take a stopped child for a live one.
        self._reap = threading.Lock()
        self._stop_r, self._stop_w = ctx.Pipe(duplex=False)
        try:
            for ws in worker_specs:
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=run_worker, args=(ws, child), name=f"kvserve-tp-rank{ws.rank}", daemon=True)
                proc.start()
                child.close()  # NOTE: only the child holds its end now, so its death reads as EOF here
                self.conns.append(parent)
                self._procs.append(proc)
            self._await_hellos()
            self.tp = init_tp_group(0, spec.size, spec.master_addr, spec.master_port, torch.device(spec.device),
                                    store)
        except BaseException:
            self.shutdown()
            raise

    def _exit_note(self, rank: int) -> str:
        proc = self._procs[rank - 1]
        with self._reap:
            proc.join(1.0)
        return "" if proc.exitcode is None else f" (exit code {proc.exitcode})"

    def _dead_worker(self, timeout_s: float) -> str | None:
        ready = wait([proc.sentinel for proc in self._procs], timeout=timeout_s)
        for rank, proc in enumerate(self._procs, start=1):
            if proc.sentinel in ready:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited{self._exit_note(rank)}"
        return None

    def _watch(self) -> None:
        threading.Thread(target=self._watcher, name="kvserve-tp-watch", daemon=True).start()

    def _watcher(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs, start=1)}
        ready = wait([*sentinels, self._stop_r])
        for s in ready:
            if s in sentinels and not self._closed:
                rank = sentinels[s]  # type: ignore[index]
                self._mark_dead(f"tensor-parallel rank {rank} (pid {self.worker_pids[rank - 1]}) exited"
                                f"{self._exit_note(rank)}")
                return

    def _stop_workers(self) -> None:
        with self._reap:
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in self._procs:
                if proc.is_alive():
                    logger.warning("tensor-parallel worker %s did not stop; killing it", proc.pid)
                    proc.kill()
                    proc.join(5.0)
        self._stop_w.close()
