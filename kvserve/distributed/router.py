"""``kvserve router``: one OpenAI-compatible front for data-parallel replicas of a model (aiohttp server and
client). Torch-free.

| route | what |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | relayed to the replica ``router_pool`` picks |
| ``GET /v1/models`` | a healthy replica's answer |
| ``GET /health`` | 200 while a replica is healthy, else 503 |
| ``GET /metrics`` | the router's own metrics (``kvserve_router_*``) |

The body goes to the replica as the client sent it (the router reads only ``prompt`` / ``messages``,
``tools``, ``cache_salt`` and ``stream``); the replica's answer comes back as it is, 4xx included. A replica
that fails before the client got any token (no connection, a dropped one, a 5xx or 429, a stream that ends
before its first token) is replaced by another, each tried once (``kvserve_router_retries_total``): a
streamed answer is held until its first event that carries a token (a chat stream's role-only first event
does not), so that a retry is invisible to the client. Once tokens went out, a broken stream ends with an
OpenAI error event, then ``[DONE]``. With no replica left the client gets a 503 in OpenAI's shape. A client
that leaves closes the replica connection, so the replica aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.disagg.proxy_backends import Backend, scrape_all, scrape_forever
from kvserve.disagg.proxy_http import (
    SSE_DONE,
    ClientGone,
    UpstreamError,
    auth_headers,
    error_body,
    error_response,
    errors_middleware,
    json_or_none,
    open_stream,
    sse,
    upstream,
    write,
)
from kvserve.distributed.prefix_index import request_block_hashes
from kvserve.distributed.router_cli import RouterConfig
from kvserve.distributed.router_pool import ReplicaPool, RouterMetrics

logger = logging.getLogger(__name__)

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router")
_HELD_MAX_BYTES = 1 << 20  # a stream's events held before its first token (more: sent on, no retry after)


def first_token_seen(held: bytes) -> bool:
    """Whether the complete SSE events in ``held`` include one past the point of no retry: an event with a
    token (non-empty text or delta, logprobs, a finish reason), usage, an error, ``[DONE]``, or one that is not
    JSON. A chat stream's first event (``{"role": "assistant", "content": ""}``) has no token."""
    for event in held.split(b"\n\n")[:-1]:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            obj = json_or_none(line[5:].strip())
            if not isinstance(obj, dict) or "error" in obj or obj.get("usage"):
                return True
            for ch in obj.get("choices") or []:
                if not isinstance(ch, dict) or ch.get("text") or ch.get("finish_reason") is not None \
                        or ch.get("logprobs"):
                    return True
                delta = ch.get("delta")
                if isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role"):
                    return True
    return False


class _Retry(Exception):
    """The replica failed before the client got anything: try another."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(error.message)
        self.error = error


class Router:
    """The router's state (replicas, indexes, counters, the upstream HTTP session) and its aiohttp app."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.pool = ReplicaPool(config.replicas, config.routing, self.metrics)
        self._session: aiohttp.ClientSession | None = None
        self._scraper: asyncio.Task[None] | None = None
        t = config.request_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=t, sock_connect=min(t, 10.0))

    def app(self) -> web.Application:
        """The aiohttp app. Serve it with ``handler_cancellation=True`` (as :func:`serve_router` and
        :func:`kvserve.distributed.router_cli.run_router` do), so that a client that leaves cancels its request."""
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[errors_middleware])
        app[ROUTER_KEY] = self
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router app is not started"
        return self._session

    async def _startup(self, app: web.Application) -> None:
        # no connection limit; idle connections dropped before the replicas' keep-alive (uvicorn: 10 s) would
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0))
        interval = self.config.health_check_interval_s
        await scrape_all(self.session, [self.pool], timeout_s=max(interval, 2.0))
        self._scraper = asyncio.ensure_future(scrape_forever(self.session, [self.pool], interval, interval))

    async def _cleanup(self, app: web.Application) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scraper
        await self.session.close()

    def _failed(self, e: UpstreamError) -> None:
        self.metrics.failures.labels(e.kind).inc()
        logger.warning("%s: %s", e.kind, e.message)

    # ---- routes --------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        if self.pool.any_healthy:
            return web.Response(status=200)
        return error_response(503, "no healthy replica", "service_unavailable")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        tried: list[Backend] = []
        while (route := self.pool.pick((), tried)) is not None:
            tried.append(route.replica)
            try:
                async with upstream(self.session, self.pool, route.replica, "GET", "/v1/models", None,
                                    auth_headers(request), self._timeout) as r:
                    return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
            except UpstreamError as e:
                self._failed(e)
        return error_response(503, "no replica answered /v1/models", "service_unavailable")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"body: more than {self.config.max_body_bytes} bytes",
                                  "invalid_request_error")
        # NOTE: a body the router cannot read still goes to a replica, whose 400 names the problem
        body = json_or_none(raw)
        body = body if isinstance(body, dict) else {}
        hashes = request_block_hashes(body, chat, self.config.block_size, self.config.block_chars)
        stream = body.get("stream") is True
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = auth_headers(request)
        tried: list[Backend] = []
        last: UpstreamError | None = None
        try:
            while (route := self.pool.pick(hashes, tried)) is not None:
                if tried:
                    self.metrics.retries.inc()
                else:
                    self.metrics.requests.labels("chat" if chat else "completions", route.reason).inc()
                tried.append(route.replica)
                try:
                    if stream:
                        return await self._relay_stream(request, route.replica, path, raw, headers)
                    return await self._relay_json(route.replica, path, raw, headers)
                except _Retry as e:
                    self._failed(e.error)
                    last = e.error
        except ClientGone:
            self.metrics.failures.labels("client_disconnect").inc()
            return web.Response(status=499)
        except asyncio.CancelledError:
            self.metrics.failures.labels("client_disconnect").inc()
            raise
        self.metrics.failures.labels("unavailable").inc()
        why = f"; the last failure: {last.message}" if last is not None else ""
        return error_response(503, f"no healthy replica could serve the request ({len(tried)} tried){why}",
                              "service_unavailable")

    # ---- relaying ------------------------------------------------------------------------------
    def _upstream(self, replica: Backend, path: str, raw: bytes, headers: dict[str, str]
                  ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]:
        return upstream(self.session, self.pool, replica, "POST", path, None, headers, self._timeout, data=raw)

    @staticmethod
    def _refused(replica: Backend, status: int, raw: bytes) -> UpstreamError | None:
        """A status another replica may answer better (5xx, 429, 1xx/3xx) as a failure; None for 200 and 4xx."""
        if status == 200 or (400 <= status < 500 and status != 429):
            return None
        kind = "replica_http_429" if status == 429 else "replica_http_5xx"
        return UpstreamError(kind, f"the replica {replica.url} answered {status}: "
                                   f"{raw[:300].decode('utf-8', 'replace')}")

    async def _relay_json(self, replica: Backend, path: str, raw: bytes, headers: dict[str, str]) -> web.Response:
        """The replica's answer as it is. Raises _Retry."""
        try:
            async with self._upstream(replica, path, raw, headers) as resp:
                data, status, ctype = await resp.read(), resp.status, resp.content_type
        except UpstreamError as e:
            raise _Retry(e) from None
        refused = self._refused(replica, status, data)
        if refused is not None:
            raise _Retry(refused)
        return web.Response(body=data, status=status, content_type=ctype)

    async def _relay_stream(self, request: web.Request, replica: Backend, path: str, raw: bytes,
                            headers: dict[str, str]) -> web.StreamResponse:
        """The replica's stream, held until its first token, then piped. Raises _Retry (before the first token),
        ClientGone."""
        out: web.StreamResponse | None = None
        held, tail = b"", b""
        try:
            async with self._upstream(replica, path, raw, headers) as resp:
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    data = await resp.read()
                    refused = self._refused(replica, resp.status, data)
                    if refused is not None:
                        raise _Retry(refused)
                    return web.Response(body=data, status=resp.status, content_type=resp.content_type)
                async for chunk in resp.content.iter_any():
                    if out is None:
                        held += chunk
                        if not first_token_seen(held) and len(held) < _HELD_MAX_BYTES:
                            continue
                        out = await open_stream(request)
                        chunk, held = held, b""
                    await write(out, chunk)
                    tail = (tail + chunk)[-len(SSE_DONE):]
        except UpstreamError as e:
            if out is None:
                raise _Retry(e) from None
            self._failed(e)
            return await self._break(out, replica)
        if out is None:
            if SSE_DONE not in held:  # it ended before its first token
                raise _Retry(UpstreamError("replica_stream", f"the replica {replica.url} ended its stream "
                                                             "before the first token"))
            out = await open_stream(request)
            await write(out, held)
        elif tail != SSE_DONE:
            self._failed(UpstreamError("replica_stream", f"the replica {replica.url} ended its stream early"))
            return await self._break(out, replica)
        return out

    async def _break(self, out: web.StreamResponse, replica: Backend) -> web.StreamResponse:
        """End a stream whose replica failed after tokens were sent: an error event, then ``[DONE]``."""
        self.metrics.failures.labels("stream_broken").inc()
        await write(out, sse(error_body(f"the replica {replica.url} failed during the stream", "server_error", 503)))
        await write(out, SSE_DONE)
        return out


@contextlib.asynccontextmanager
async def serve_router(config: RouterConfig, host: str = "127.0.0.1", port: int = 0
                       ) -> AsyncIterator[tuple[str, Router]]:
    """Run the router in the current event loop; yields its base URL (``port`` 0: a free port) and state."""
    router = Router(config)
    runner = web.AppRunner(router.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield f"http://{bound_host}:{bound_port}", router
    finally:
        await runner.cleanup()
