"""One data-parallel replica inside a Ray actor: a whole ``kvserve serve`` (its own engine, KV cache and torch
threads, its OpenAI server on its node's address), so that the router in front relays plain HTTP.

Why whole servers rather than engines behind one API server: every OpenAI detail (chat templates, tool calls,
logprobs, errors, metrics) already lives in the server, and a replica that dies is seen the same way as one
on another host behind ``kvserve router`` (its port refuses connections); nothing is pickled per token
through Ray's object store. The cost is one loopback (or veth) HTTP hop per request.

This module imports Ray only inside functions; the actor class is made by :func:`replica_actor_class`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 300.0


class ReplicaServer:
    """The body of the Ray actor (a plain class, so it can be tested without Ray).

    Args:
        args: the ``kvserve serve`` namespace (engine and server flags; ``--host``/``--port`` are ignored: the
            replica listens on ``host`` at a free port).
        index: the replica's rank in the deployment (0..N-1), for logs.
        host: the address to listen on (its node's IP; None: ``ray.util.get_node_ip_address()``).
    """

    def __init__(self, args: argparse.Namespace, index: int, host: str | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s replica{index} %(name)s: %(message)s")
        from kvserve.entrypoints.openai.server import build_app, build_context

        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        self.index = index
        self.host = host
        ctx = build_context(args)  # loads the model (seconds)
        self._app = build_app(ctx, cors={"allow_origins": args.allowed_origins, "allow_methods":
                                         args.allowed_methods, "allow_headers": args.allowed_headers,
                                         "allow_credentials": args.allow_credentials})
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = int(self._sock.getsockname()[1])
        self._server: Any = None
        self._thread = threading.Thread(target=self._serve, args=(args,), name=f"replica{index}-http", daemon=True)
        self._thread.start()
        self._wait_started()

    def _serve(self, args: argparse.Namespace) -> None:
        import uvicorn

        config = uvicorn.Config(self._app, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=10)
        self._server = uvicorn.Server(config)
        self._server.run(sockets=[self._sock])  # not the main thread: uvicorn installs no signal handlers

    def _wait_started(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not (self._server is not None and self._server.started):
            if not self._thread.is_alive():
                raise RuntimeError(f"replica {self.index}: its HTTP server exited at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {self.index}: its HTTP server did not start in {_STARTUP_TIMEOUT_S} s")
            time.sleep(0.05)

    def url(self) -> str:
        """The replica's base URL, ``http://<node ip>:<port>``."""
        return f"http://{self.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        """Where it runs: ``url``, ``node_ip``, ``pid``, ``index``."""
        return {"url": self.url(), "node_ip": self.host, "pid": os.getpid(), "index": self.index}

    def shutdown(self) -> None:
        """Stop serving (the engine loop stops with the app's lifespan)."""
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=15)


def replica_actor_class(num_cpus: float) -> Any:
    """``ReplicaServer`` as a Ray actor class asking for ``num_cpus`` logical CPUs (Ray then sets the worker's
    ``OMP_NUM_THREADS`` to it). Not restarted by Ray: a dead replica leaves the router's rotation."""
    import ray

    return ray.remote(num_cpus=num_cpus, max_restarts=0)(ReplicaServer)
