"""AsyncLLM: the synchronous LLMEngine behind an asyncio API, for the server.

    asyncio event loop (HTTP)                    engine loop thread (owns the LLMEngine)
    ─────────────────────────                    ──────────────────────────────────────
    add_request() ──▶ inbox (deque + Condition) ──▶ add / abort between steps
    RequestStream ◀── call_soon_threadsafe ◀──────── step() outputs, once per step

The engine is not thread-safe: only the loop thread ever touches it. The HTTP side hands adds and aborts
over through the inbox; the loop thread drains the inbox before every step and sleeps on the condition
when there is nothing to do (no busy polling). Outputs go back with one ``call_soon_threadsafe`` per step.

Inline mode (``inline=True``, ``kvserve serve --engine-loop inline``; off by default, see ``AsyncLLM``):
the same loop runs as an asyncio task on the event loop's own thread. A step blocks the event loop; between
steps the task hands the outputs to the streams directly and yields until their handlers have run. No thread
hand-off is left on the per-token path: the thread version's two wake-ups per step (the event loop's, then
the engine thread's) cost ~0.3 ms a token on a 2-vCPU VM (measured: see ``AsyncLLM``'s ``inline``).

Each request's outputs are cumulative snapshots (whole text so far), so a :class:`RequestStream` keeps only
the newest one: a slow client never makes outputs pile up, it just gets bigger deltas.

If the loop itself crashes (not a model error, which the engine confines to the requests of that step),
the AsyncLLM is dead: every open stream fails with :class:`EngineDeadError`, new requests are refused,
and the server's ``/health`` answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.errors import EngineDeadError, ExecutorDeadError, KVServeError
from kvserve.metrics import EngineMetrics
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine, PromptType

logger = logging.getLogger(__name__)

# While requests wait but none can be scheduled (nothing running), wait this long between tries (s).
_STALL_WAIT_S = 0.01
# Longest the loop thread waits for the event loop to hand a step's outputs to their streams (s); see
# AsyncLLM's ``lockstep``.
_DELIVERY_WAIT_S = 0.05


class TooManyRequestsError(KVServeError):
    """More requests are waiting than ``max_waiting_requests`` allows (HTTP 429)."""

    status_code = 429
    error_type = "rate_limit_error"


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str | None
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative :class:`RequestOutput` snapshots.

    Iteration ends after the output with ``finished`` set; it raises the error of a request that could not
    be added (``InvalidRequestError`` ...), or ``EngineDeadError``. Leaving early (``abort()``, or a
    cancelled consumer in a ``try/finally`` that calls it) aborts the request in the engine.
    """

    def __init__(self, request_id: str, owner: AsyncLLM) -> None:
        self.request_id = request_id
        self._owner = owner
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finished = False

    # ---- event loop side, called by AsyncLLM ---------------------------------------------------
    def _accept(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._fail(error)

    def _put(self, out: RequestOutput) -> None:
        self._latest = out  # cumulative: the newest snapshot replaces an unread older one
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()
        if not self._accepted.done():
            self._accepted.set_exception(error)
            self._accepted.exception()  # mark retrieved (no "never retrieved" log); awaiting still raises

    # ---- consumer side -------------------------------------------------------------------------
    async def accepted(self) -> None:
        """Wait until the engine queued the request.

        Raises:
            InvalidRequestError, PromptTooLongError, TooManyRequestsError, EngineDeadError: not queued.
        """
        await self._accepted

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._event.clear()
            await self._event.wait()
        out = self._latest
        if out is None:
            self.finished = True
            assert self._error is not None
            raise self._error
        self._latest = None
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        """Abort the request unless it already finished; its KV blocks are freed before the next step."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


def build_engine_off_main_thread(config: Any) -> LLMEngine:
    """``LLMEngine(config)``, built in a short-lived thread so that the calling thread never starts an
    OpenMP team.

    Why: libgomp keeps one pool of worker threads per thread that ever ran a parallel region, for the
    life of that thread (the main thread: the process). When the threads of all pools outnumber the CPUs
    it "throttles" its spin-wait to ~1,000 iterations, so a worker sleeps on a futex after every parallel
    region and each of the ~150 regions of a decode step pays a wake-up (~50 us here). Built in the main
    thread, the engine leaves a pool there; the engine loop thread then makes a second one, and on a
    2-CPU host a decode step took 17 ms instead of 9 ms (measured, SmolLM2 bf16, 2 threads). A thread
    that exits frees its pool, so building here leaves only the loop thread's.

    Raises:
        whatever ``LLMEngine(config)`` raises, re-raised in the caller's thread.
    """
    from kvserve.engine.llm_engine import LLMEngine

    result: list[LLMEngine] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            result.append(LLMEngine(config))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)

    thread = threading.Thread(target=build, name="kvserve-engine-build")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


class AsyncLLM:
    """An :class:`LLMEngine` driven by one background thread, with per-request async streams.

    Args:
        engine: the engine; from now on only the loop thread touches it.
        metrics: Prometheus metrics to feed (a new :class:`EngineMetrics` when None).
        max_waiting_requests: refuse (429) a request when more sequences than this would wait for a batch
            slot; None: no limit.
        lockstep: after each step, wait (at most ``_DELIVERY_WAIT_S``) until the event loop has handed the
            step's outputs to the request handlers and they have run, before the next step's compute. On a
            host with as many CPUs as compute threads, HTTP work running beside a step takes a core from one
            OpenMP thread and the others spin at every barrier: measured on 2 CPUs (SmolLM2 bf16, 2 threads,
            64 streams) the overlap cost more than doing the two one after the other. None: on when the
            engine computes on the CPU with as many threads as the process may use.
        inline: run the engine loop as a task on the event loop's thread instead of its own thread (implies
            lockstep: the handlers always run between two steps). Off by default. Measured
            on 2 vCPUs (SmolLM2 bf16, 2 threads, one streamed request, timestamps in the loop): the gap between
            two steps is 0.66-0.70 ms inline against 0.95-0.97 ms with the thread's two hand-offs, of which
            ~0.55 ms is the handlers' own work (half of it the socket write that wakes the client). Through the
            server against the thread in the same rounds (window s27, docs/performance-log.md) it was no
            consistent win: batch-1 decode 0.94x, A c1 1.03x, A c16 0.92x, A c64 1.13x, B c16 1.03x.

    Call :meth:`start` from the running event loop, :meth:`shutdown` to stop.
    """

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None,
                 max_waiting_requests: int | None = None, lockstep: bool | None = None,
                 inline: bool = False) -> None:
        self.engine = engine
        if lockstep is None:
            device = getattr(getattr(engine, "device", None), "type", None)
            threads = getattr(engine, "num_threads", None)
            # (tensor parallelism: every rank's threads compute at once)
            ranks = getattr(getattr(engine, "executor", None), "world_size", 1)
            lockstep = device == "cpu" and threads is not None and threads * ranks >= len(os.sched_getaffinity(0))
        self.inline = inline
        self.lockstep = lockstep or self.inline
        self._delivered = threading.Event()
        name = engine.config.served_model_name or engine.config.model
        self.metrics = metrics or EngineMetrics(name)
        self.max_waiting_requests = max_waiting_requests
        self._cond = threading.Condition()
        self._inbox: deque[_Add | _Abort] = deque()
        self._stopping = False
        self._dead: EngineDeadError | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None  # inline mode: the engine loop
        self._wakeup: asyncio.Event | None = None  # inline mode: set when the inbox has work (or on stop)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event loop thread only
        self._live: set[str] = set()  # loop thread only: ids inside the engine
        self._ids = itertools.count()
        self._last_stats: object = None  # loop thread only: the scheduler snapshot the gauges show
        # Called (in the event loop) when the loop died because a tensor-parallel rank died: the server stops.
        self.on_executor_dead: Callable[[], None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop (its thread, or its task in inline mode); call from inside the running
        asyncio loop."""
        assert self._thread is None and self._task is None, "AsyncLLM.start() called twice"
        self._loop = asyncio.get_running_loop()
        if self.inline:
            self._wakeup = asyncio.Event()
            self._task = self._loop.create_task(self._run_inline(), name="kvserve-engine-loop")
            return
        self._thread = threading.Thread(target=self._run, name="kvserve-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread (after the step in progress) and fail every open stream.

        Args:
            timeout_s: how long to wait for the thread (s).
        """
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._task is not None:  # inline: the task is parked at an await (never inside a step) here
            assert self._loop is not None
            if self._on_loop_thread():
                self._task.cancel()
            else:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the task is gone with it
                    self._loop.call_soon_threadsafe(self._task.cancel)
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()  # queued KV blocks reach the offload tiers (disk survives the restart)

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    # ---- requests (event loop thread) ----------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queue a request; returns its stream at once. Await ``stream.accepted()`` for admission errors.

        Raises:
            EngineDeadError: the engine loop is dead or shutting down.
        """
        assert self._loop is not None, "AsyncLLM.start() was not called"
        if self._dead is not None:
            raise self._dead
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        item = _Add(request_id, prompt, params, time.monotonic(), priority, cache_salt, stream)
        with self._cond:
            if self._dead is not None or self._stopping:
                del self._streams[request_id]
                raise self._dead or EngineDeadError("the server is shutting down")
            self._inbox.append(item)
            self._cond.notify()
        self._wake_task()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); never blocks."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.finished = True
        with self._cond:
            self._inbox.append(_Abort(request_id))
            self._cond.notify()
        self._wake_task()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream._put(out)
            if out.finished:
                del self._streams[out.request_id]
        # The handlers woken above run as the loop's next callbacks; this runs after them (lockstep).
        assert self._loop is not None
        if not self.inline:
            self._loop.call_soon(self._loop.call_soon, self._delivered.set)

    def _accept(self, stream: RequestStream, error: BaseException | None) -> None:
        stream._accept(error)
        if error is not None:
            self._streams.pop(stream.request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(error)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        # RuntimeError: the event loop is closed (process exit); nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            if self.inline and self._on_loop_thread():
                self._loop.call_soon(fn, *args)  # (no self-pipe write: nothing to wake)
            else:
                self._loop.call_soon_threadsafe(fn, *args)

    def _on_loop_thread(self) -> bool:
        assert self._loop is not None
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs in this thread
            return False

    def _wake_task(self) -> None:
        """Inline mode: wake the engine task (from any thread); no-op for the thread version."""
        if self._wakeup is None:
            return
        if self._on_loop_thread():
            self._wakeup.set()
        else:
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._wakeup.set)

    # ---- the engine loop (loop thread) ---------------------------------------------------------
    def _setup_compute_thread(self) -> tuple[Callable[[], None] | None, Callable[[], float | None]]:
        """Size and pin the calling thread's OpenMP team and hook the wake-ups; returns the engine's
        ``(poll_background, idle_wait_s)`` (None / no timeout for an engine double without them)."""
        engine = self.engine
        import torch  # (the module itself stays importable without torch)

        num_threads = getattr(engine, "num_threads", None)  # (an engine double may not say)
        if num_threads:
            torch.set_num_threads(num_threads)  # OpenMP's count is per calling thread
        bind = getattr(engine, "bind_compute_threads", None)
        if bind is not None:
            bind()  # this thread's OpenMP team, pinned to CPUs (--cpu-threads-bind)
        # Background work of an idle engine (PD disaggregation: blocks pinned for a decode instance are
        # freed when it confirms, or when their timeout passes); an engine double may have none.
        poll = getattr(engine, "poll_background", None)
        idle_wait = getattr(engine, "idle_wait_s", lambda: None)
        connector = getattr(engine, "connector", None)
        if connector is not None:
            connector.wakeup = self._wake
        executor = getattr(engine, "executor", None)
        if executor is not None:
            executor.wakeup = self._wake  # a tensor-parallel rank that dies while the engine is idle
        return poll, idle_wait

    def _idle(self) -> bool:
        return not (self._inbox or self._stopping or self.engine.has_unfinished_requests())

    def _iterate(self, items: list[_Add | _Abort], poll: Callable[[], None] | None) -> list[RequestOutput]:
        """One turn of the engine loop after the inbox was drained: adds and aborts, one step, metrics.

        Raises:
            whatever ``engine.step()`` or the metrics raise (the loop then dies; a bad request's own error goes
            to its stream in ``_add`` instead).
        """
        engine = self.engine
        if poll is not None and not engine.has_unfinished_requests():
            poll()  # (a busy engine does the same in every step's schedule())
        for item in items:
            if isinstance(item, _Add):
                self._add(item)
            else:
                self._abort(item.request_id)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        now = time.monotonic()
        for out in outputs:
            self.metrics.on_output(out, now)
            if out.finished:
                self._live.discard(out.request_id)
        return outputs

    def _stalled(self, outputs: list[RequestOutput]) -> bool:
        """Nothing could be scheduled (requests wait, none runs): wait for a change rather than spin."""
        sched = self.engine.scheduler
        return not outputs and sched.num_running == 0 and sched.num_waiting > 0

    def _died(self, e: BaseException) -> None:
        logger.exception("the engine loop died; the server can no longer serve requests")
        with self._cond:
            self._dead = EngineDeadError(f"the engine loop died: {type(e).__name__}: {e}")
        self._call_soon(self._fail_all, self._dead)
        if isinstance(e, ExecutorDeadError) and self.on_executor_dead is not None:
            self._call_soon(self.on_executor_dead)

    def _run(self) -> None:
        """The engine loop thread."""
        try:
            poll, idle_wait = self._setup_compute_thread()
            while True:
                with self._cond:
                    if self._idle():
                        self._cond.wait(idle_wait())
                    if self._stopping:
                        return
                    items = list(self._inbox)
                    self._inbox.clear()
                outputs = self._iterate(items, poll)
                if outputs:
                    self._delivered.clear()
                    self._call_soon(self._deliver, outputs)
                    if self.lockstep:
                        self._delivered.wait(_DELIVERY_WAIT_S)
                dead = getattr(self.engine, "dead_error", None)
                if dead is not None:  # a tensor-parallel rank died: its requests got their errors above
                    raise dead
                self._update_gauges()
                if self._stalled(outputs):
                    with self._cond:  # nothing could be scheduled: do not spin until something changes
                        self._cond.wait(_STALL_WAIT_S)
        except BaseException as e:  # noqa: BLE001 - the loop must report its death, whatever killed it
            self._died(e)

    async def _run_inline(self) -> None:
        """The engine loop as a task of the event loop (inline mode): the same turns as ``_run``; between
        two steps it hands the outputs to the streams and yields until their handlers have run."""
        assert self._loop is not None
        loop = self._loop
        try:
            poll, idle_wait = self._setup_compute_thread()
            while True:
                if self._idle():
                    await self._wait_wakeup(idle_wait())
                if self._stopping:
                    return
                with self._cond:
                    items = list(self._inbox)
                    self._inbox.clear()
                outputs = self._iterate(items, poll)
                if outputs:
                    self._deliver(outputs)
                    handled = loop.create_future()  # resolved after the handlers woken above have run
                    loop.call_soon(loop.call_soon, handled.set_result, None)
                    await handled
                dead = getattr(self.engine, "dead_error", None)
                if dead is not None:
                    raise dead
                self._update_gauges()
                if self._stalled(outputs):
                    await self._wait_wakeup(_STALL_WAIT_S)
                elif not outputs:
                    await asyncio.sleep(0)  # let the HTTP side in between steps that return nothing
        except asyncio.CancelledError:
            return  # shutdown(): the engine was parked at an await, never inside a step
        except BaseException as e:  # noqa: BLE001 - the loop must report its death, whatever killed it
            self._died(e)

    async def _wait_wakeup(self, timeout_s: float | None) -> None:
        """Inline mode: wait until the inbox gets work, ``_wake`` is called or ``timeout_s`` passes."""
        assert self._wakeup is not None
        self._wakeup.clear()
        if self._inbox or self._stopping:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout_s)

    def _wake(self) -> None:
        """Wake the engine loop (called from other threads, e.g. the KV connector's server)."""
        with self._cond:
            self._cond.notify()
        self._wake_task()

    def _add(self, item: _Add) -> None:
        error: BaseException | None = None
        try:
            self._check_capacity(item.params.n)
            self.engine.add_request(item.request_id, item.prompt, item.params, item.arrival_time,
                                    item.priority, item.cache_salt)
            self._live.add(item.request_id)
            self.metrics.on_added(item.request_id, item.arrival_time)
        except KVServeError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the loop
            logger.exception("add_request failed for %s", item.request_id)
            error = e
        self._call_soon(self._accept, item.stream, error)

    def _check_capacity(self, n: int) -> None:
        limit = self.max_waiting_requests
        if limit is None:
            return
        sched = self.engine.scheduler
        # Sequences (each of a request's n samples counts) that will still wait after the next schedule()
        # filled the free batch slots; the samples of running leaders take slots too.
        free_slots = max(self.engine.config.max_num_seqs - sched.num_running - sched.num_pending_forks, 0)
        queued = sched.num_waiting_sequences
        if queued + n - free_slots > limit:
            raise TooManyRequestsError(
                f"too many requests waiting: {queued} sequences queued and this request adds {n}, limit "
                f"--max-waiting-requests {limit}; retry later")

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        if request_id in self._live:
            self._live.discard(request_id)
            self.metrics.on_aborted(request_id, time.monotonic())

    def _update_gauges(self) -> None:
        stats = self.engine.scheduler.make_stats()
        # Steady decoding leaves the snapshot unchanged for most steps (~80 us of gauge updates saved each);
        # timings drained into a snapshot (offload loads, KV transfers) are new samples even when equal.
        drained = ((stats.offload is not None and bool(stats.offload.load_seconds))
                   or (stats.transfer is not None and bool(stats.transfer.transfer_seconds)))
        if drained or stats != self._last_stats:
            self._last_stats = stats
            self.metrics.update_engine_state(stats)
