"""The ZMQ KV connector: a prefill instance pins and serves a finished prompt's KV blocks, a decode instance
pulls them and continues the request. Torch-free: the runner's export function turns block ids into bytes.

    producer (P)                                         consumer (D)
    Scheduler._finish(length-capped, do_remote_decode)   Scheduler admission, request with do_remote_prefill:
      └─ pin(): the blocks' KV copied out ──┐              └─ lookup(): a pull runs in a thread (the request
    server thread (ROUTER, kv_ip:kv_port) ◀── Pull ────────── is passed over, the batch goes on); when its
      export(block ids) ──── PullReply + payloads ──────────▶ payloads are in: fresh blocks, loaded before the
      ◀── Release (or kv_transfer_timeout_s) ─────────────── forward, num_computed = the prompt
    take_releases(): the scheduler frees the blocks        a failed pull: the prompt is recomputed (counted)

Prefix-cache hits on D are not pulled (``first_block``).

A pin holds the prompt's KV as block payloads in host memory, copied by the engine thread when the request
finishes (one gather per layer and one device -> host copy, as the transfer needs anyway); the device blocks
are then released at once (they stay in P's prefix cache as free, evictable blocks), so a slow or absent
decode instance never holds P's KV cache. The server thread only sends bytes: it never touches torch, whose
per-op GIL hand-offs with a busy engine thread made a pull of ~20 blocks take ~50 ms when it gathered the
blocks itself. A pin being served is never expired under the reader.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import msgspec
import zmq

from kvserve.core.block_hash import BlockHash
from kvserve.core.request import Request
from kvserve.disagg.config import KVTransferConfig
from kvserve.disagg.protocol import (
    CHECKSUM_ALGO,
    DECODER,
    ENCODER,
    Pull,
    PullReply,
    Release,
    Released,
    RemoteDecode,
    RemotePrefill,
    TransferError,
    checksum,
    pull_blocks,
    release_remote,
)

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("timeout", "unknown", "fingerprint", "range", "protocol", "checksum", "hash", "connection")


@dataclass(frozen=True)
class TransferSnapshot:
    """Totals for the metrics (``transfer_seconds``: the pulls finished since the last snapshot)."""

    pulls: int
    bytes_received: int
    bytes_sent: int
    blocks_served: int
    failures: dict[str, int]
    recomputed_requests: int
    pinned_blocks: int
    pins_expired: int
    transfer_seconds: list[float]


@dataclass
class _Pin:
    payloads: list[bytes]  # one per block of the prompt (the last may be partial)
    checksums: list[int]
    block_hashes: list[BlockHash]
    num_tokens: int
    deadline: float
    busy: int = 0  # pulls being served from it


@dataclass
class _PullState:
    first_block: int
    future: Future[tuple[PullReply, list[bytes], float]] | None
    payloads: list[bytes] | None = None  # received and checked
    failed: bool = False


class ZmqConnector:
    """Both halves of the connector; ``config.kv_role`` decides which run.

    Args:
        config: the validated ``--kv-transfer-config``.
        fingerprint: this engine's model fingerprint (P refuses pulls from another model).
        block_size: tokens per block.
        block_nbytes: bytes of one block payload (all layers, K and V).
        dtype / block_shape: the payload's layout (``ModelRunner.offload_block_shape``), sent in the header.
        export: block ids -> one payload per block (``ModelRunner.export_blocks``); called on the server
            thread.

    Raises:
        zmq.ZMQError: the producer's port cannot be bound.
    """

    def __init__(self, config: KVTransferConfig, fingerprint: str, block_size: int, block_nbytes: int,
                 dtype: str, block_shape: Sequence[int], export: Callable[[list[int]], list[bytes]]) -> None:
        self.config = config
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.dtype = dtype
        self.block_shape = list(block_shape)
        self._export = export
        # Fault injection for tests only: a producer that answers pulls this many seconds late (so that a test
        # can kill it mid-transfer). Unset in any real deployment.
        self._serve_delay_s = float(os.environ.get("KVSERVE_TEST_KV_SERVE_DELAY_S", "0"))
        self.engine_id = config.engine_id or uuid.uuid4().hex[:12]
        # Called from the server thread when a release arrives, so that an idle engine loop runs
        # ``take_releases`` at once (AsyncLLM sets it).
        self.wakeup: Callable[[], None] = lambda: None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._lock = threading.Lock()
        # producer
        self._pins: dict[str, _Pin] = {}
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._server: threading.Thread | None = None
        self._stop = threading.Event()
        self.port = config.kv_port
        # consumer
        self._pulls: dict[str, _PullState] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-transfer-pull")
        # counters
        self._n_pulls = self._bytes_in = self._bytes_out = self._blocks_out = 0
        self._failures: dict[str, int] = {}
        self._recomputed = 0
        self._expired = 0
        self._seconds: list[float] = []
        if config.is_producer:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            if config.kv_port == 0:
                self.port = sock.bind_to_random_port(f"tcp://{config.kv_ip}")
            else:
                sock.bind(f"tcp://{config.kv_ip}:{config.kv_port}")
            self._server = threading.Thread(target=self._serve, args=(sock,), name="kv-transfer-server",
                                            daemon=True)
            self._server.start()

    # ---- producer: scheduler thread --------------------------------------------------------------
    def wants_pin(self, request: Request) -> bool:
        """Whether a finished request's blocks stay for a decode instance (it asked ``do_remote_decode``)."""
        return self.config.is_producer and isinstance(request.kv_transfer, RemoteDecode)

    def pin(self, request: Request, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> RemotePrefill:
        """Copy the KV of ``block_ids`` (the request's table, covering its prompt) and keep it until released
        or expired (the caller frees the blocks); returns the parameters a decode instance needs (set as the
        request's ``kv_transfer_out``). Engine thread: the forward that wrote these blocks has run."""
        num_tokens = request.num_prompt_tokens
        ids = list(block_ids)[:-(-num_tokens // self.block_size)]
        payloads = self._export(ids)
        pin = _Pin(payloads, [checksum(p) for p in payloads], list(block_hashes), num_tokens,
                   time.monotonic() + self.config.kv_transfer_timeout_s)
        with self._lock:
            self._pins[request.request_id] = pin
        return RemotePrefill(self.config.kv_ip, self.port, request.request_id, self.engine_id, num_tokens,
                             list(request.output_token_ids))

    def take_releases(self) -> list[str]:
        """Drop the pins confirmed by D, or expired; returns their request ids."""
        out: list[str] = []
        while True:
            try:
                rid = self._released.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                if self._pins.pop(rid, None) is not None:
                    out.append(rid)
        if self._pins:
            now = time.monotonic()
            with self._lock:
                for rid in [r for r, p in self._pins.items() if p.deadline <= now and not p.busy]:
                    del self._pins[rid]
                    self._expired += 1
                    out.append(rid)
                    logger.warning("kv transfer: %s was not pulled within %.1f s; its blocks are freed", rid,
                                   self.config.kv_transfer_timeout_s)
        return out

    def next_deadline_s(self) -> float | None:
        """Seconds until the earliest pin expires (None: nothing pinned); an idle engine wakes then."""
        with self._lock:
            if not self._pins:
                return None
            return max(0.0, min(p.deadline for p in self._pins.values()) - time.monotonic())

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks of KV held (in host memory) for decode instances to pull."""
        with self._lock:
            return sum(len(p.payloads) for p in self._pins.values())

    # ---- producer: server thread -----------------------------------------------------------------
    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                ident, *frames = sock.recv_multipart()
                try:
                    msg = DECODER.decode(frames[-1])
                except msgspec.DecodeError:
                    sock.send_multipart([ident, ENCODER.encode(PullReply("protocol"))])
                    continue
                if isinstance(msg, Release):
                    with self._lock:
                        found = msg.request_id in self._pins
                    if found:
                        self._released.put(msg.request_id)
                        self.wakeup()
                    sock.send_multipart([ident, ENCODER.encode(Released(found))])
                elif isinstance(msg, Pull):
                    sock.send_multipart([ident, *self._answer(msg)], copy=False)
                else:
                    sock.send_multipart([ident, ENCODER.encode(PullReply("protocol"))])
        except Exception:  # noqa: BLE001 - log the death of the server thread; pins then expire
            logger.exception("kv transfer server thread died")
        finally:
            sock.close(linger=0)

    def _answer(self, msg: Pull) -> list[bytes]:
        with self._lock:
            pin = self._pins.get(msg.request_id)
            if pin is not None:
                pin.busy += 1
        if pin is None:
            return [ENCODER.encode(PullReply("unknown"))]
        try:
            if self._serve_delay_s > 0:
                time.sleep(self._serve_delay_s)
            if msg.fingerprint != self.fingerprint:
                return [ENCODER.encode(PullReply("fingerprint"))]
            if not 0 <= msg.first_block <= len(pin.payloads):
                return [ENCODER.encode(PullReply("range"))]
            payloads = pin.payloads[msg.first_block:]
            reply = PullReply("ok", pin.num_tokens, msg.first_block, [bytes(h) for h in
                              pin.block_hashes[msg.first_block:]], self.dtype, self.block_shape,
                              self.block_nbytes, CHECKSUM_ALGO, pin.checksums[msg.first_block:])
            with self._lock:
                self._bytes_out += sum(len(p) for p in payloads)
                self._blocks_out += len(payloads)
            return [ENCODER.encode(reply), *payloads]
        finally:
            with self._lock:
                pin.busy -= 1

    # ---- consumer: scheduler thread --------------------------------------------------------------
    def lookup(self, request: Request, first_block: int) -> tuple[list[bytes], int] | None:
        """For a request with ``do_remote_prefill``: the payloads of its prompt's blocks from
        ``first_block`` (the blocks before hit this instance's prefix cache) and the prompt tokens they
        complete, or None while the pull runs (pass the request over). ``([], 0)``: the pull failed; the
        prompt is recomputed (counted in ``recomputed_requests``).

        ``request.block_hashes`` must hold the prompt's chain (``BlockManager.request_block_hashes``).
        The payloads stay here until :meth:`finish` (call it once the request is admitted or finished, to
        let P free its blocks): a request that could not be admitted gets them again next step.
        """
        params = request.kv_transfer
        assert isinstance(params, RemotePrefill)
        rid = request.request_id
        if first_block * self.block_size >= params.num_prompt_tokens:  # every prompt block hit locally
            return [], params.num_prompt_tokens
        st = self._pulls.get(rid)
        if st is None:
            self._start_pull(request, params, first_block)
            return None
        if st.failed:
            return [], 0
        if st.payloads is None:
            assert st.future is not None
            if not st.future.done():
                return None
            try:
                reply, payloads, seconds = st.future.result()
            except TransferError as e:
                return self._failed(st, rid, e.kind, str(e))
            except Exception as e:  # noqa: BLE001 - any transport fault means: recompute
                return self._failed(st, rid, "connection", f"{type(e).__name__}: {e}")
            nfull = params.num_prompt_tokens // self.block_size - reply.first_block
            ours = [bytes(h) for h in request.block_hashes[reply.first_block:reply.first_block + nfull]]
            if (reply.num_tokens != params.num_prompt_tokens or reply.block_nbytes != self.block_nbytes
                    or len(ours) != nfull or reply.block_hashes[:nfull] != ours):
                return self._failed(st, rid, "hash", "the prefill instance's blocks are not this prompt's")
            with self._lock:
                self._n_pulls += 1
                self._bytes_in += sum(len(p) for p in payloads)
                self._seconds.append(seconds)
            st.payloads, st.future = payloads, None
        if first_block < st.first_block:  # the local hits shrank meanwhile: pull again from there
            self._start_pull(request, params, first_block)
            return None
        return st.payloads[first_block - st.first_block:], params.num_prompt_tokens

    def _start_pull(self, request: Request, params: RemotePrefill, first_block: int) -> None:
        self._pulls[request.request_id] = _PullState(first_block, self._pool.submit(self._pull, params, first_block))

    def _pull(self, params: RemotePrefill, first_block: int) -> tuple[PullReply, list[bytes], float]:
        """One pull on a pool thread; the seconds are the transfer's own (asked to checked), not the wait for
        the engine's next step that picks the result up."""
        t0 = time.perf_counter()
        reply, payloads = pull_blocks(self._ctx, params, first_block, self.fingerprint,
                                      self.config.kv_transfer_timeout_s)
        return reply, payloads, time.perf_counter() - t0

    def _failed(self, st: _PullState, rid: str, kind: str, message: str) -> tuple[list[bytes], int]:
        logger.warning("kv transfer of %s failed (%s); recomputing its prompt", rid, message)
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1
            self._recomputed += 1
        st.failed, st.future = True, None
        return [], 0

    def finish(self, request: Request) -> None:
        """The request was admitted, finished or aborted: tell P to free its pinned blocks (in the
        background; an unreachable P frees them by its timeout)."""
        st = self._pulls.pop(request.request_id, None)
        params = request.kv_transfer
        if not isinstance(params, RemotePrefill):
            return
        request.kv_transfer = None  # a later recompute (preemption) is a plain prefill
        if st is not None and st.future is not None:
            st.future.cancel()  # (a pull already running completes; P still gets the release below)
        self._pool.submit(release_remote, self._ctx, params.remote_host, params.remote_port,
                          params.remote_request_id, min(2.0, self.config.kv_transfer_timeout_s))

    def wait_pulls(self, timeout_s: float) -> None:
        """Block until a pull finishes or ``timeout_s`` passes (an idle engine waiting for KV sleeps here)."""
        pending = [s.future for s in self._pulls.values() if s.future is not None and not s.future.done()]
        if pending:
            wait(pending, timeout=timeout_s, return_when="FIRST_COMPLETED")

    @property
    def num_pulling(self) -> int:
        return sum(1 for s in self._pulls.values() if s.future is not None and not s.future.done())

    # ---- both ------------------------------------------------------------------------------------
    def snapshot(self) -> TransferSnapshot:
        with self._lock:
            seconds, self._seconds = self._seconds, []
            pinned = sum(len(p.payloads) for p in self._pins.values())
            return TransferSnapshot(self._n_pulls, self._bytes_in, self._bytes_out, self._blocks_out,
                                    dict(self._failures), self._recomputed, pinned, self._expired, seconds)

    def close(self) -> None:
        """Stop the server thread and the pulls; pinned blocks die with the engine."""
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
        # A pull or release still running owns a socket of the context: terminate it once they are done
        # (each is bounded by its timeout), never under them (a zmq socket is not thread-safe).
        threading.Thread(target=self._term_when_idle, name="kv-transfer-close", daemon=True).start()

    def _term_when_idle(self) -> None:
        self._pool.shutdown(wait=True)
        self._ctx.term()
