"""``kvserve router``: its flags and their validated form, :class:`RouterConfig`. Imports nothing heavy (the
``kvserve`` command builds every subcommand's parser at start).

    kvserve router --replica http://10.0.0.1:8000 http://10.0.0.2:8000 --port 8080 --policy cache-aware
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvserve.disagg.proxy_cli import check_base_urls, check_seconds
from kvserve.distributed.router_pool import POLICIES, RoutingConfig
from kvserve.errors import InvalidRequestError


@dataclass(frozen=True)
class RouterConfig:
    """What the router runs with.

    Attributes:
        replicas: base URLs of the replicas (``http://host:port``, no trailing ``/``), each a ``kvserve serve``
            (or any OpenAI server with ``/health`` and Prometheus ``/metrics``) of the same model.
        routing: the policy and its thresholds.
        health_check_interval_s: seconds between probes of every replica's ``/health`` and ``/metrics``; a probe
            may take as long before it is left as it was.
        request_timeout_s: the longest one replica request may take, a whole stream included (seconds).
        block_size: tokens per block of a prompt given as token ids (the replicas' ``--block-size``).
        block_chars: characters per block of a prompt given as text.
        max_body_bytes: the largest client request body accepted (a larger one is a 413).
    """

    replicas: tuple[str, ...]
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health_check_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    block_size: int = 16
    block_chars: int = 64
    max_body_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        """Raises InvalidRequestError naming the flag: a bad URL, interval, timeout or block size."""
        check_base_urls("replica", self.replicas)
        check_seconds("health_check_interval", self.health_check_interval_s)
        check_seconds("request_timeout", self.request_timeout_s)
        for name in ("block_size", "block_chars"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name}: must be >= 1, got {getattr(self, name)}", param=name)

    @classmethod
    def from_urls(cls, replicas: list[str], **kwargs: Any) -> RouterConfig:
        """A config from URLs as given (a trailing ``/`` dropped); see ``__post_init__`` for errors."""
        return cls(tuple(u.rstrip("/") for u in replicas), **kwargs)


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """The routing flags, shared by ``kvserve router`` and ``kvserve serve --data-parallel-size``."""
    g = p.add_argument_group("routing")
    g.add_argument("--policy", choices=POLICIES, default="cache-aware",
                   help="cache-aware (default): the replica holding the longest prefix of the prompt unless the "
                        "load is imbalanced; least-loaded: fewest in-flight + running + waiting; round-robin")
    g.add_argument("--health-check-interval", type=float, default=1.0,
                   help="seconds between probes of each replica's /health and /metrics (default 1)")
    g.add_argument("--cache-threshold", type=float, default=0.5,
                   help="fraction of the prompt's blocks a replica must hold to win on affinity (default 0.5)")
    g.add_argument("--balance-abs-threshold", type=float, default=8.0,
                   help="load difference (sequences) above which cache-aware routes by load (default 8) ...")
    g.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... when the most loaded replica also has this times the least's load (default 1.5)")
    g.add_argument("--kv-usage-threshold", type=float, default=0.9,
                   help="a replica with at least this KV cache usage never wins on affinity (default 0.9)")
    g.add_argument("--max-index-blocks", type=int, default=1 << 16,
                   help="LRU bound of the router's prefix index, block hashes per replica (default 65536)")
    g.add_argument("--router-block-chars", type=int, default=64,
                   help="characters per block when hashing a text prompt (default 64)")


def routing_config(args: argparse.Namespace, replicas: list[str]) -> RouterConfig:
    """The config of the routing flags in ``args`` (``--block-size`` when the command has it).

    Raises:
        InvalidRequestError: a bad value (``param`` names it).
    """
    try:
        routing = RoutingConfig(policy=args.policy, cache_threshold=args.cache_threshold,
                                balance_abs_threshold=args.balance_abs_threshold,
                                balance_rel_threshold=args.balance_rel_threshold,
                                kv_usage_threshold=args.kv_usage_threshold, max_index_blocks=args.max_index_blocks)
    except ValueError as e:
        raise InvalidRequestError(str(e), param=str(e).split(":", 1)[0]) from None
    return RouterConfig.from_urls(replicas, routing=routing, health_check_interval_s=args.health_check_interval,
                                  request_timeout_s=args.request_timeout,
                                  block_size=getattr(args, "block_size", None) or 16,
                                  block_chars=args.router_block_chars)


def add_router_parser(sub: Any) -> None:
    """Add ``kvserve router`` to the ``kvserve`` command's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "router", help="run the data-parallel router (one OpenAI API in front of several replicas)",
        description="An OpenAI-compatible front for data-parallel replicas of one model: each request goes to "
                    "the replica that already holds the longest prefix of its prompt (with its cache_salt), "
                    "balanced against load; failed replicas leave the rotation and their requests are retried.")
    p.add_argument("--replica", nargs="+", required=True, metavar="URL", help="the replicas' base URLs")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    p.add_argument("--block-size", type=int, default=16,
                   help="the replicas' KV block size, for prompts given as token ids (default 16)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one replica request may take, a whole stream included (default 600)")
    add_routing_args(p)
    p.set_defaults(func=cmd_router)

    def one_line_error(message: str) -> NoReturn:
        p.exit(2, f"kvserve router: error: {message} (see kvserve router --help)\n")

    p.error = one_line_error  # type: ignore[method-assign]  # a bad flag: one line, not the usage text


def cmd_router(args: argparse.Namespace) -> int:
    """``kvserve router``: serve until interrupted. Returns the exit code.

    Raises:
        InvalidRequestError: a bad flag value, or the address cannot be listened on.
    """
    if not 0 < args.port <= 65535:
        raise InvalidRequestError(f"port: {args.port} is not in 1..65535", param="port")
    return run_router(routing_config(args, args.replica), args.host, args.port)


def run_router(config: RouterConfig, host: str, port: int) -> int:
    """Serve the router on ``host:port`` until interrupted (SIGINT, SIGTERM). Returns the exit code.

    Raises:
        InvalidRequestError: ``host:port`` cannot be listened on (``param`` is ``port``).
    """
    from aiohttp import web

    from kvserve.distributed.router import Router

    app = Router(config).app()
    print(f"[kvserve] router on http://{host}:{port}: replicas {', '.join(config.replicas)}; policy "
          f"{config.routing.policy}", file=sys.stderr, flush=True)
    try:
        web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None, print=None)
    except OSError as e:
        raise InvalidRequestError(f"port: cannot listen on {host}:{port}: {e.strerror or e}", param="port") from None
    return 0
