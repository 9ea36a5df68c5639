"""Rank 0's side of tensor parallelism, whatever runs the other ranks (processes: ``multiproc.py``; Ray actors:
``ray_executor.py``).

Rank 0 lives in the engine process: the scheduler hands it the ``SchedulerOutput`` by a function call, it samples
on the gathered logits and returns the ``ModelRunnerOutput`` without any serialization, and only ranks 1..N-1
need the step sent to them (one pickled ``WorkerStep`` per step, written to each worker's connection before rank
0 starts its own forward). A separate rank-0 process would add a round trip and the outputs' pickling to every
step and overlap nothing: the engine's loop waits for each step anyway.

Start-up, in the engine (``LLMEngine.__init__``)::

    ex = MultiprocExecutor(spec)   workers started; every rank joined the process group -> ex.tp
    build_model(..., tp=ex.tp)     rank 0's shard (the workers load theirs meanwhile)
    ex.agree_num_blocks(n)         the smallest of every rank's KV block budget
    ex.start(runner, ...)          the workers build their runners; steps may run

Failures: a worker that dies closes its connection and its sockets, so rank 0's next collective, send or wait
fails at once (a worker that hangs fails rank 0's collective after ``COLLECTIVE_TIMEOUT_S``): the executor is
then dead (``ExecutorDeadError``), every remaining worker is stopped, and the engine fails its requests.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import re
import threading
import time
import weakref
from abc import abstractmethod
from multiprocessing.connection import Connection, wait
from typing import Any

from kvserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvserve.distributed.tp_group import TPGroup, destroy_tp_group
from kvserve.errors import ExecutorDeadError
from kvserve.executor.base import Executor
from kvserve.executor.worker import WorkerSpec
from kvserve.executor.worker_step import StepEncoder
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Longest wait for a worker to start: import, join the group and load its shard (a large checkpoint from a slow
# disk). A worker that dies meanwhile is noticed at once (its connection closes).
STARTUP_TIMEOUT_S = 600.0
# Longest wait for a worker's answer to a call after start-up (the prefill probe).
CALL_TIMEOUT_S = 300.0
_STOP_TIMEOUT_S = 10.0
_START_HINT = (" (its error is in the log above; a script that starts the engine must do so under "
               "`if __name__ == \"__main__\":`, since each worker process imports the script as it starts)")


class DistributedExecutor(Executor):
    """Rank 0 plus workers reached through one ``Connection`` each (``conns[r - 1]`` is rank ``r``'s).

    Subclasses start the workers and join the process group in their constructor (setting ``tp``, ``conns``
    and ``worker_pids``), and say how to stop them and how to notice a death while idle.
    """

    tp: TPGroup
    conns: list[Connection]
    worker_pids: list[int]

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec  # rank 0's (``cpus``: rank 0's); each worker's differs in rank and cpus
        self.conns = []
        self.worker_pids = []
        self._encoder = StepEncoder()
        self._dead: str | None = None
        self._closed = False
        # native ids of the threads rank 0 computed in (pinned to rank 0's CPUs) -> their CPUs before
        self._pinned: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        # NOTE: before multiprocessing's own exit handler (registered earlier, so it runs later) terminates the
        # workers, which the watcher would report as deaths
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    @property
    def world_size(self) -> int:
        return self.spec.size

    # ---- start-up ----------------------------------------------------------------------------------------
    def _await_hellos(self) -> None:
        """Every worker's ``("hello", rank, pid)``: it runs and is about to join the process group."""
        for rank, conn in enumerate(self.conns, start=1):
            kind, got, pid = self._recv(conn, rank, STARTUP_TIMEOUT_S, "start", _START_HINT)
            assert kind == "hello" and got == rank, (kind, got)
            self.worker_pids.append(pid)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank can hold: the smallest of rank 0's ``num_blocks`` and each worker's own budget
        (it reports it once its shard is loaded; waits for that).

        Raises:
            ExecutorDeadError: a worker failed to load (its error in the message) or died.
        """
        budgets = [self._recv(conn, rank, STARTUP_TIMEOUT_S, "load its shard")
                   for rank, conn in enumerate(self.conns, start=1)]
        for kind, _ in budgets:
            assert kind == "ready", kind
        return min([num_blocks] + [n for _, n in budgets])

    def start(self, driver: ModelRunner, num_blocks: int, num_host_blocks: int) -> None:
        """Hand the workers the cache geometry and wait until each built its runner; ``driver`` is rank 0's.

        Raises:
            ExecutorDeadError: a worker failed or died.
        """
        self.driver = driver
        self._broadcast(pickle.dumps(("init", num_blocks, num_host_blocks)))
        for rank, conn in enumerate(self.conns, start=1):
            self._recv(conn, rank, STARTUP_TIMEOUT_S, "allocate its KV cache")
        self._watch()

    # ---- steps -------------------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        self._pin_driver_thread()
        self._broadcast(pickle.dumps(("step", self._encoder.encode(so)), protocol=pickle.HIGHEST_PROTOCOL))
        try:
            return self.driver.execute_model(so)
        except Exception as e:
            if not self.driver.collectives_pending:
                raise  # after the step's last collective: the ranks are in step; only this step failed
            raise self._die(self._failure(e, "step")) from e

    def measure_prefill_speed(self, num_tokens: int) -> float:
        self.check_health()  # (not pinned: the engine is built in a short-lived thread)
        self._broadcast(pickle.dumps(("measure_prefill_speed", num_tokens)))
        try:
            speed = self.driver.measure_prefill_speed(num_tokens)
        except Exception as e:
            raise self._die(self._failure(e, "prefill probe")) from e
        for rank, conn in enumerate(self.conns, start=1):
            self._recv(conn, rank, CALL_TIMEOUT_S, "answer the prefill probe")
        return speed

    def forget_requests(self, request_ids: list[str]) -> None:
        self.driver.logits_processors.release(request_ids)
        for request_id in request_ids:
            self.driver.generators.pop(request_id, None)
        self._encoder.forget(request_ids)

    def check_health(self) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)

    # ---- plumbing ----------------------------------------------------------------------------------------
    def _broadcast(self, payload: bytes) -> None:
        """Write ``payload`` to every worker. Raises ExecutorDeadError when a worker's connection is gone."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                raise self._die(f"tensor-parallel rank {rank} is gone ({type(e).__name__}: {e})") from None

    def _recv(self, conn: Connection, rank: int, timeout_s: float, what: str, hint: str = "") -> Any:
        """The next message of ``rank`` (an ``("error", text)`` or a closed connection raises), within
        ``timeout_s``; ``hint`` is added to the error of a worker that died without a word.

        Raises:
            ExecutorDeadError: the worker failed, died or did not answer in time (``what`` says at what).
        """
        deadline = time.monotonic() + timeout_s
        while not wait([conn], timeout=1.0):
            if self._dead is not None:
                raise ExecutorDeadError(self._dead)
            if time.monotonic() > deadline:
                raise self._die(f"tensor-parallel rank {rank} did not {what} within {timeout_s:.0f} s")
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            raise self._die(f"tensor-parallel rank {rank} died before it could {what}"
                            f"{self._exit_note(rank)}{hint}") from None
        if msg[0] == "error":
            raise self._die(str(msg[1]))
        return msg

    def _failure(self, e: Exception, what: str) -> str:
        """Why rank 0's ``what`` failed mid-collectives: the worker that died, when one did (its sockets closing is
        what failed the collective), and the collective's own error in short."""
        brief = re.sub(r"^\[[^\]]*\]\s*", "", str(e)).split(". ")[0]  # gloo: "[file:line] Read error ...: reset"
        dead = self._dead_worker(2.0)
        cause = f"rank 0's {what} failed: {type(e).__name__}: {brief}"
        return f"{dead} ({cause})" if dead else cause

    def _dead_worker(self, timeout_s: float) -> str | None:
        """``tensor-parallel rank r (pid p) exited ...`` for a worker found dead within ``timeout_s``, else None."""
        return None

    def _die(self, reason: str) -> ExecutorDeadError:
        """Record the death (with the workers' own error reports, when they sent any), stop every worker, and
        return the error to raise."""
        with self._lock:
            if self._dead is None:
                reports = self._error_reports()
                self._dead = reason + "".join(f"; {r}" for r in reports if r not in reason)
        logger.error("tensor parallelism stopped: %s", self._dead)
        self.shutdown()
        return ExecutorDeadError(self._dead)

    def _error_reports(self) -> list[str]:
        """The ``("error", text)`` messages workers sent before dying (read without blocking)."""
        reports = []
        for conn in self.conns:
            try:
                while conn.poll(0.2):
                    msg = pickle.loads(conn.recv_bytes())
                    if msg[0] == "error":
                        reports.append(str(msg[1]))
            except (EOFError, OSError, pickle.UnpicklingError):
                continue
        return reports

    def _pin_driver_thread(self) -> None:
        """Pin the thread rank 0 computes in to rank 0's CPUs, the first time it computes (OpenMP threads it
        starts later inherit that)."""
        tid = threading.get_native_id()
        if self.spec.cpus is None or tid in self._pinned:
            return
        self._pinned[tid] = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.spec.cpus)

    def _unpin_driver_threads(self) -> None:
        """Give the threads rank 0 computed in their CPUs back (the caller's thread outlives the executor)."""
        for tid, cpus in self._pinned.items():
            with contextlib.suppress(OSError):  # (a thread that has exited)
                os.sched_setaffinity(tid, cpus)
        self._pinned.clear()

    def _exit_note(self, rank: int) -> str:
        """`` (exit code N)`` where the backend knows it."""
        return ""

    def _mark_dead(self, reason: str) -> None:
        """A watcher saw a worker die while the engine was idle: record it and wake the engine."""
        with self._lock:
            if self._dead is not None or self._closed:
                return
            self._dead = reason + "".join(f"; {r}" for r in self._error_reports())
        logger.error("tensor parallelism stopped: %s", self._dead)
        if self.wakeup is not None:
            self.wakeup()

    @abstractmethod
    def _watch(self) -> None:
        """Start noticing worker deaths while no step runs (calls ``_mark_dead``)."""

    @abstractmethod
    def _stop_workers(self) -> None:
        """Make every worker exit (after ``shutdown`` was sent; kill those that do not)."""

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        bye = pickle.dumps(("shutdown",))
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(bye)
        self._stop_workers()
        for conn in self.conns:
            conn.close()
        destroy_tp_group()
        self._unpin_driver_threads()


def _shutdown_at_exit(ref: weakref.ReferenceType[DistributedExecutor]) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()
