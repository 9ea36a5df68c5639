"""``kvserve proxy``: its flags and their validated form, :class:`ProxyConfig`. Imports nothing heavy (the
``kvserve`` command builds every subcommand's parser at start).

    kvserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Any, NoReturn

from kvserve.errors import InvalidRequestError

ROUTINGS = ("least-loaded", "round-robin")


def check_base_urls(flag: str, urls: tuple[str, ...]) -> None:
    """Raises InvalidRequestError naming ``flag``: no URL, one that is not a base URL (``http://host:port``, no
    path, query or fragment), a bad port, or a URL listed twice."""
    if not urls:
        raise InvalidRequestError(f"{flag}: give at least one URL", param=flag)
    for u in urls:
        parts = urllib.parse.urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.fragment:
            raise InvalidRequestError(f"{flag}: {u!r} is not a base URL such as http://127.0.0.1:8100", param=flag)
        try:
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            raise InvalidRequestError(f"{flag}: {u!r} has a bad port", param=flag) from None
    if len(set(urls)) != len(urls):
        raise InvalidRequestError(f"{flag}: a URL is listed twice", param=flag)


def check_seconds(name: str, value: float) -> None:
    """Raises InvalidRequestError naming ``name`` unless ``value`` is a positive finite number of seconds."""
    if not value > 0 or value == float("inf"):
        raise InvalidRequestError(f"{name}: must be a positive number of seconds, got {value}", param=name)


@dataclass(frozen=True)
class ProxyConfig:
    """What the proxy runs with.

    Attributes:
        prefill, decode: base URLs of the prefill and decode instances (``http://host:port``, no trailing ``/``).
        routing: ``least-loaded`` or ``round-robin`` (see ``proxy_backends``).
        metrics_interval_s: seconds between scrapes of every backend's ``/health`` (and ``/metrics``).
        request_timeout_s: the longest one backend request may take, a whole stream included (seconds).
        max_body_bytes: the largest client request body accepted (a larger one is a 413).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    routing: str = "least-loaded"
    metrics_interval_s: float = 0.5
    request_timeout_s: float = 600.0
    max_body_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        """Raises InvalidRequestError naming the flag: no or a malformed or repeated URL, an unknown routing, a
        non-positive interval or timeout."""
        for flag, urls in (("prefill", self.prefill), ("decode", self.decode)):
            check_base_urls(flag, urls)
        if self.routing not in ROUTINGS:
            raise InvalidRequestError(f"routing: {self.routing!r} is not one of {', '.join(ROUTINGS)}",
                                      param="routing")
        check_seconds("metrics_interval", self.metrics_interval_s)
        check_seconds("request_timeout", self.request_timeout_s)

    @classmethod
    def from_urls(cls, prefill: list[str], decode: list[str], **kwargs: Any) -> ProxyConfig:
        """A config from URLs as given (a trailing ``/`` dropped); see ``__post_init__`` for errors."""
        return cls(tuple(u.rstrip("/") for u in prefill), tuple(u.rstrip("/") for u in decode), **kwargs)


def add_proxy_parser(sub: Any) -> None:
    """Add ``kvserve proxy`` to the ``kvserve`` command's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "proxy", help="run the prefill/decode disaggregation proxy (an OpenAI API in front of P and D instances)",
        description="An OpenAI-compatible front for prefill/decode disaggregation: each choice is prefilled on a "
                    "prefill instance (one token, its KV kept), streamed to the client at once, and continued on "
                    "a decode instance that pulls that KV.")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (kvserve serve ... --kv-transfer-config with kv_role kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    p.add_argument("--routing", choices=ROUTINGS, default="least-loaded",
                   help="least-loaded (default): fewest in-flight + running + waiting requests, from each "
                        "backend's /metrics; round-robin: in turn")
    p.add_argument("--metrics-interval", type=float, default=0.5,
                   help="seconds between scrapes of each backend's /health and /metrics (default 0.5)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one backend request may take, a whole stream included (default 600)")
    p.set_defaults(func=cmd_proxy)

    def one_line_error(message: str) -> NoReturn:
        p.exit(2, f"kvserve proxy: error: {message} (see kvserve proxy --help)\n")

    p.error = one_line_error  # type: ignore[method-assign]  # a bad flag: one line, not the usage text


def cmd_proxy(args: argparse.Namespace) -> int:
    """``kvserve proxy``: serve until interrupted. Returns the exit code.

    Raises:
        InvalidRequestError: a bad flag value, or the address cannot be listened on.
    """
    if not 0 < args.port <= 65535:
        raise InvalidRequestError(f"port: {args.port} is not in 1..65535", param="port")
    config = ProxyConfig.from_urls(args.prefill, args.decode, routing=args.routing,
                                   metrics_interval_s=args.metrics_interval, request_timeout_s=args.request_timeout)
    return run_proxy(config, args.host, args.port)


def run_proxy(config: ProxyConfig, host: str, port: int) -> int:
    """Serve the proxy on ``host:port`` until interrupted (SIGINT, SIGTERM). Returns the exit code.

    Raises:
        InvalidRequestError: ``host:port`` cannot be listened on (``param`` is ``port``).
    """
    from aiohttp import web

    from kvserve.disagg.proxy import Proxy

    app = Proxy(config).app()
    print(f"[kvserve] proxy on http://{host}:{port}: prefill {', '.join(config.prefill)}; decode "
          f"{', '.join(config.decode)}; routing {config.routing}", file=sys.stderr, flush=True)
    try:
        web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None, print=None)
    except OSError as e:
        raise InvalidRequestError(f"port: cannot listen on {host}:{port}: {e.strerror or e}", param="port") from None
    return 0
