"""``--distributed-executor-backend ray``: ranks 1..N-1 as Ray actors (one placement group, ``STRICT_PACK``: the
ranks of one model on one node), each running the same worker loop as an mp worker (``worker.run_worker``).

Ray places and supervises the processes; nothing per step goes through Ray: each actor connects back to rank 0
over TCP (``multiprocessing.connection`` with a random auth key) on 127.0.0.1, and the collectives run over
gloo / NCCL as with ``mp``. Without a Ray runtime in this process a local single-node cluster is started on
127.0.0.1 (``distributed/data_parallel.start_ray``: no usage stats, workers not niced) and shut down with the
executor; one already initialized (``ray.init`` by the caller) is used and left running.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import secrets
import threading
import time
import weakref
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import kvserve
from kvserve.distributed.tp_group import init_tp_group
from kvserve.executor.distributed import _STOP_TIMEOUT_S, STARTUP_TIMEOUT_S, DistributedExecutor, _shutdown_at_exit
from kvserve.executor.worker import WorkerSpec, run_worker

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0


class RayWorker:
    """The actor's body: one tensor-parallel worker (a plain class; ``ray.remote`` wraps it)."""

    def run(self, spec: WorkerSpec) -> None:
        """The worker's whole life (returns after rank 0's ``shutdown``; the actor process exits on a failure)."""
        run_worker(spec)


class RayExecutor(DistributedExecutor):
    """Starts one Ray actor per worker rank and joins the process group with them.

    Args:
        spec: rank 0's spec.
        store: the rendezvous store (``tp_group.create_store``), listening at ``spec.master_port``.
        worker_specs: ranks 1..N-1's (their ``address`` and ``authkey`` are filled in here).
    Raises:
        InvalidRequestError: the cluster cannot place the actors within a minute.
        ExecutorDeadError: an actor died or failed before joining.
    """

    def __init__(self, spec: WorkerSpec, worker_specs: list[WorkerSpec], store: dist.Store) -> None:
        super().__init__(spec)
        import ray

        from kvserve.distributed.data_parallel import start_ray

        self._local = False
        self._actors: list[Any] = []
        self._refs: list[Any] = []
        self._pg: Any = None
        authkey = secrets.token_bytes(32)
        self._listener = Listener((spec.master_addr, 0), authkey=authkey)
        try:
            if not ray.is_initialized():
                self._local = start_ray(None, spec.size * spec.threads)
            self._start_actors(ray, worker_specs, authkey)
            self._accept(ray, len(worker_specs))
            self.tp = init_tp_group(0, spec.size, spec.master_addr, spec.master_port, torch.device(spec.device),
                                    store)
            # ray.init registered its own shutdown at exit, after this executor's: exit handlers run last in, first
            # out, so without this one Ray would be down before the actors are stopped, and their handles'
            # destructors would reach a shut-down core worker (which ends the process with exit code 1).
            atexit.register(_shutdown_at_exit, weakref.ref(self))
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, ray: Any, worker_specs: list[WorkerSpec], authkey: bytes) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from kvserve.errors import InvalidRequestError

        threads = self.spec.threads
        self._pg = placement_group([{"CPU": float(threads)}] * len(worker_specs), strategy="STRICT_PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise InvalidRequestError(
                f"tensor_parallel_size: the Ray cluster cannot place {len(worker_specs)} workers of {threads} CPU(s) "
                f"on one node (it has {ray.cluster_resources().get('CPU', 0):g} CPUs)", param="tensor_parallel_size")
        # The actors import kvserve from where this process did (a checkout or an install).
        root = str(Path(kvserve.__file__).resolve().parent.parent)
        pythonpath = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {k: v for k, v in os.environ.items() if k.startswith("KVSERVE_")} | {"PYTHONPATH": pythonpath}
        cls = ray.remote(num_cpus=threads, max_restarts=0)(RayWorker)
        for i, ws in enumerate(worker_specs):
            ws.address, ws.authkey = self._listener.address, authkey
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
            actor = cls.options(scheduling_strategy=strategy, runtime_env={"env_vars": env}).remote()
            self._actors.append(actor)
            self._refs.append(actor.run.remote(ws))

    def _accept(self, ray: Any, n: int) -> None:
        """Each actor's connection, ordered by rank (they connect in any order; their hello names the rank)."""
        accepted: list[Connection] = []

        def accept() -> None:
            try:
                for _ in range(n):
                    accepted.append(self._listener.accept())
            except OSError:  # the listener was closed: start-up failed
                return

        threading.Thread(target=accept, name="kvserve-tp-accept", daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(accepted) < n:
            done, _ = ray.wait(self._refs, timeout=0.5)
            if done:
                raise self._die(f"a tensor-parallel Ray worker exited at start: {_ref_error(ray, done[0])}")
            if time.monotonic() > deadline:
                raise self._die(f"the tensor-parallel Ray workers did not connect within {STARTUP_TIMEOUT_S:.0f} s")
        self.conns = accepted  # (in connection order until the hellos name the ranks)
        hellos = []
        for i, conn in enumerate(accepted, start=1):
            kind, rank, pid = self._recv(conn, i, STARTUP_TIMEOUT_S, "start")
            assert kind == "hello", kind
            hellos.append((rank, pid, conn))
        hellos.sort(key=lambda h: h[0])
        self.conns = [c for _, _, c in hellos]
        self.worker_pids = [pid for _, pid, _ in hellos]

    def _dead_worker(self, timeout_s: float) -> str | None:
        import ray

        done, _ = ray.wait(self._refs, timeout=timeout_s)
        if not done:
            return None
        rank = self._refs.index(done[0]) + 1
        return (f"tensor-parallel rank {rank} (Ray actor, pid {self.worker_pids[rank - 1]}) exited: "
                f"{_ref_error(ray, done[0])}")

    def _watch(self) -> None:
        self._watch_thread = threading.Thread(target=self._watcher, name="kvserve-tp-watch", daemon=True)
        self._watch_thread.start()

    def _watcher(self) -> None:
        import ray

        while not self._closed:
            done, _ = ray.wait(self._refs, timeout=1.0)
            if done and not self._closed:
                self._mark_dead(self._dead_worker(0.0) or "a tensor-parallel Ray worker exited")
                return

    def _stop_workers(self) -> None:
        import ray

        self._listener.close()
        if not ray.is_initialized():
            return
        if self._refs:
            ray.wait(self._refs, num_returns=len(self._refs), timeout=_STOP_TIMEOUT_S)
        for actor in self._actors:
            ray.kill(actor)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        # Nothing may touch Ray after ray.shutdown(): its core worker ends the process (exit code 1) when a
        # call or a handle's destructor reaches it. The watcher leaves its ray.wait within 1 s of _closed;
        # the refs and handles are dropped while Ray is up.
        watcher = getattr(self, "_watch_thread", None)
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=5.0)
        self._refs, self._actors, self._pg = [], [], None
        gc.collect()
        if self._local:
            ray.shutdown()


def _ref_error(ray: Any, ref: Any) -> str:
    """What a finished actor call ended with (its error, or that it returned)."""
    try:
        ray.get(ref, timeout=5)
    except Exception as e:  # noqa: BLE001 - the reason is the message
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "it returned"
