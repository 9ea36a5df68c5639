"""``kvserve proxy``: an OpenAI-compatible front for prefill/decode disaggregation (aiohttp server and client).

| route | what |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | each choice: P (one token, KV kept), then D |
| ``GET /v1/models`` | a healthy decode instance's answer |
| ``GET /health`` | 200 while a decode instance is healthy, else 503 |
| ``GET /metrics`` | the proxy's own counters (``kvserve_proxy_*``) |

Per choice ``i`` (``proxy_requests`` builds the bodies): P answers one token plus ``kv_transfer_params``; a
streaming client gets that token at once, then D's chunks (``index`` ``i``, the proxy's ``id``/``created``/
``model``); a non-streaming one gets P's text + D's. A P that fails (connection, timeout, 5xx, a broken
answer) is replaced by another, each tried once; with none left D recomputes the choice whole. A P 4xx is the
client's, relayed unchanged. A D failure is a 503 (streamed: an error event, then ``[DONE]``). A client that
leaves cancels the upstream requests (their connections close, so the backends abort them), and P's pinned KV
of a choice no D completed is released over ZMQ (``protocol.release_remote``). ``max_tokens: 1`` (or a value
the proxy cannot read) goes to a P as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.disagg import proxy_requests as pr
from kvserve.disagg.protocol import RemotePrefill, release_remote
from kvserve.disagg.proxy_backends import Backend, BackendPool, ProxyMetrics, scrape_all, scrape_forever
from kvserve.disagg.proxy_cli import ProxyConfig
from kvserve.disagg.proxy_http import (
    SSE_DONE,
    ClientGone,
    Relayed,
    UpstreamError,
    auth_headers,
    cancel_all,
    error_body,
    error_response,
    errors_middleware,
    failure_response,
    http_error,
    json_or_none,
    open_stream,
    sse,
    sse_events,
    upstream,
    write,
)
from kvserve.entrypoints.openai.json_body import parse_json_object
from kvserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

T = TypeVar("T")
PROXY_KEY: web.AppKey[Proxy] = web.AppKey("proxy")
_QUEUE_CHUNKS = 64  # streamed chunks buffered per request before D's stream is read on (backpressure)


@dataclass
class _Chunk:
    choice: dict[str, Any]


@dataclass
class _Done:
    completion_tokens: int


_Event = _Chunk | _Done | UpstreamError | Relayed


class Proxy:
    """The proxy's state (backends, counters, the upstream HTTP session) and its aiohttp app."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.prefill = BackendPool([Backend(u, "prefill") for u in config.prefill], config.routing, self.metrics)
        self.decode = BackendPool([Backend(u, "decode") for u in config.decode], config.routing, self.metrics)
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task[Any]] = set()
        t = config.request_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=t, sock_connect=min(t, 10.0))

    def app(self) -> web.Application:
        """The aiohttp app. Serve it with ``handler_cancellation=True`` (as :func:`serve_proxy` and
        :func:`kvserve.disagg.proxy_cli.run_proxy` do), so that a client that leaves cancels its upstream requests."""
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[errors_middleware])
        app[PROXY_KEY] = self
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
        assert self._session is not None, "the proxy app is not started"
        return self._session

    async def _startup(self, app: web.Application) -> None:
        # no connection limit; idle connections dropped before the backends' keep-alive (uvicorn: 10 s) would
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0))
        pools = [self.prefill, self.decode]
        await scrape_all(self.session, pools, timeout_s=2.0)
        self._spawn(scrape_forever(self.session, pools, self.config.metrics_interval_s))

    async def _cleanup(self, app: web.Application) -> None:
        for t in list(self._background):
            if not t.get_name().startswith("release"):
                t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.session.close()

    def _spawn(self, coro: Awaitable[Any], name: str = "background") -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _failed(self, e: UpstreamError | Relayed, role: str = "") -> None:
        kind = e.kind if isinstance(e, UpstreamError) else f"{role}_http_4xx"
        self.metrics.failures.labels(kind).inc()
        if isinstance(e, UpstreamError):
            logger.warning("%s: %s", kind, e.message)

    # ---- routes --------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        if self.decode.any_healthy:
            return web.Response(status=200)
        return error_response(503, "no healthy decode instance", "service_unavailable")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _models(self, request: web.Request) -> web.Response:
        tried: list[Backend] = []
        while (d := self.decode.pick(tried)) is not None:
            tried.append(d)
            try:
                async with self._upstream(d, "GET", "/v1/models", None, auth_headers(request)) as r:
                    return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)
            except UpstreamError as e:
                self._failed(e)
        return error_response(503, "no decode instance answered /v1/models", "service_unavailable")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"body: more than {self.config.max_body_bytes} bytes",
                                   "invalid_request_error")
        try:
            body = pr.check_request(parse_json_object(raw.decode("utf-8")), chat)
        except UnicodeDecodeError as e:
            self.metrics.failures.labels("invalid_request").inc()
            return error_response(400, f"body: not valid UTF-8 ({e.reason} at byte {e.start})",
                                   "invalid_request_error")
        except InvalidRequestError as e:
            self.metrics.failures.labels("invalid_request").inc()
            return error_response(400, e.message, "invalid_request_error", e.param)
        job = pr.Job(body, chat, auth_headers(request))
        split = pr.splittable(body, chat)
        self.metrics.requests.labels(endpoint, "split" if split else "passthrough").inc()
        try:
            if not split:
                return await self._passthrough(request, job)
            if body.get("stream"):
                return await self._split_stream(request, job)
            return await self._split_json(job)
        except ClientGone:
            self.metrics.failures.labels("client_disconnect").inc()
            return web.Response(status=499)
        except asyncio.CancelledError:
            self.metrics.failures.labels("client_disconnect").inc()
            raise
        finally:
            self._release(job)

    # ---- upstream requests ---------------------------------------------------------------------
    def _upstream(self, backend: Backend, method: str, path: str, body: dict[str, Any] | None,
                  headers: dict[str, str]) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]:
        pool = self.prefill if backend.role == "prefill" else self.decode
        return upstream(self.session, pool, backend, method, path, body, headers, self._timeout)

    async def _prefill(self, job: pr.Job, i: int) -> pr.Prefilled | None:
        """Choice ``i``'s token from a P, each P tried at most once; None when none answered (then it is
        counted as a fallback to D recompute).

        Raises:
            Relayed: a P answered 4xx.
        """
        body = pr.prefill_body(job.body, job.chat, i)
        tried: list[Backend] = []
        while (p := self.prefill.pick(tried)) is not None:
            if tried:
                self.metrics.prefill_retries.inc()
            tried.append(p)
            try:
                async with self._upstream(p, "POST", job.path, body, job.headers) as resp:
                    raw, status, ctype = await resp.read(), resp.status, resp.content_type
                    data = json_or_none(raw) if status == 200 else None
                    remote = pr.remote_of(data)
                    if remote is not None:  # at once: from here on a cancel still releases it
                        job.pinned[i] = remote
                if 400 <= status < 500:
                    raise Relayed(status, raw, ctype)
                if status != 200:
                    raise UpstreamError("prefill_http_5xx", f"the prefill instance {p.url} answered {status}: "
                                                            f"{raw[:300].decode('utf-8', 'replace')}")
                try:
                    pre = pr.parse_prefill(data, job.chat)
                except ValueError as e:
                    self._release(job, i)
                    raise UpstreamError("prefill_bad_response", f"the prefill instance {p.url}: {e}") from None
            except UpstreamError as e:
                self._failed(e)
                continue
            except Relayed as e:
                self._failed(e, "prefill")
                raise
            job.note(pre.model, pre.prompt_tokens)
            return pre
        self.metrics.fallback_recompute.inc()
        logger.warning("no prefill instance answered (%d tried): the decode instance recomputes the prompt",
                       len(tried))
        return None

    async def _on_decode(self, attempt: Callable[[Backend], Awaitable[T]]) -> T:
        """``attempt`` on a D; again on another D only when the connection was never made.

        Raises:
            UpstreamError: no healthy D, or the D failed; Relayed: the D answered 4xx.
        """
        tried: list[Backend] = []
        while True:
            d = self.decode.pick(tried)
            if d is None:
                e = UpstreamError("decode_unavailable", "no healthy decode instance")
                self._failed(e)
                raise e
            tried.append(d)
            try:
                return await attempt(d)
            except UpstreamError as e:
                self._failed(e)
                if not e.unsent:
                    raise
            except Relayed as e:
                self._failed(e, "decode")
                raise

    async def _decode_json(self, job: pr.Job, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """D's single choice and completion tokens, not streamed."""
        async def attempt(d: Backend) -> tuple[dict[str, Any], int]:
            async with self._upstream(d, "POST", job.path, body, job.headers) as resp:
                if resp.status != 200:
                    raise await http_error(d, resp)
                data = json_or_none(await resp.read())
            choices = data.get("choices") if isinstance(data, dict) else None
            if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
                raise UpstreamError("decode_bad_response", f"the decode instance {d.url} answered no single choice")
            prompt_tokens, completion_tokens = pr.usage_of(data)
            job.note(data.get("model"), prompt_tokens)
            return choices[0], completion_tokens if completion_tokens is not None else 1

        return await self._on_decode(attempt)

    async def _decode_stream(self, job: pr.Job, i: int, body: dict[str, Any], queue: asyncio.Queue[_Event],
                             shift: int, drop_role: bool) -> int:
        """Relay D's stream for choice ``i`` into ``queue``; returns D's completion tokens."""
        async def attempt(d: Backend) -> int:
            completion: int | None = None
            async with self._upstream(d, "POST", job.path, body, job.headers) as resp:
                if resp.status != 200:
                    raise await http_error(d, resp)
                async for obj in sse_events(resp, "decode"):
                    if "error" in obj:
                        err = obj["error"]
                        why = err.get("message") if isinstance(err, dict) else err
                        raise UpstreamError("decode_stream", f"the decode instance {d.url} failed the request: "
                                                             f"{why}")
                    prompt_tokens, c = pr.usage_of(obj)
                    job.note(obj.get("model"), prompt_tokens)
                    completion = c if c is not None else completion
                    for ch in obj.get("choices") or []:
                        out = pr.relay_choice(ch, job.chat, i, shift, drop_role) if isinstance(ch, dict) else None
                        if out is not None:
                            await queue.put(_Chunk(out))
            return completion if completion is not None else 1

        return await self._on_decode(attempt)

    def _release(self, job: pr.Job, i: int | None = None) -> None:
        """Release (in the background) what P pinned for choice ``i`` (None: every choice no D completed)."""
        for k in [i] if i is not None else list(job.pinned):
            remote = job.pinned.pop(k, None)
            if remote is not None:
                self._spawn(self._release_remote(remote), name="release")

    async def _release_remote(self, r: RemotePrefill) -> None:
        try:
            found = await asyncio.to_thread(release_remote, None, r.remote_host, r.remote_port, r.remote_request_id)
        except Exception as e:  # noqa: BLE001 - e.g. a malformed address; P frees the blocks at its timeout
            logger.warning("could not release the KV of %s on %s:%d: %s", r.remote_request_id, r.remote_host,
                           r.remote_port, e)
            return
        logger.info("released the KV of %s on %s:%d (held: %s)", r.remote_request_id, r.remote_host,
                    r.remote_port, found)

    # ---- the three ways through ----------------------------------------------------------------
    async def _passthrough(self, request: web.Request, job: pr.Job) -> web.StreamResponse:
        """The request as is to a P (each tried once), else to a D; its answer relayed."""
        for pool in (self.prefill, self.decode):
            tried: list[Backend] = []
            while (b := pool.pick(tried)) is not None:
                if tried and pool is self.prefill:
                    self.metrics.prefill_retries.inc()
                tried.append(b)
                try:
                    async with self._upstream(b, "POST", job.path, job.body, job.headers) as resp:
                        if resp.status >= 500 or resp.status < 200:
                            raise UpstreamError(f"{b.role}_http_5xx", f"the {b.role} instance {b.url} answered "
                                                                      f"{resp.status}")
                        if resp.status == 200 and resp.content_type == "text/event-stream":
                            return await self._pipe(request, b, resp)
                        raw = await resp.read()
                        return web.Response(body=raw, status=resp.status, content_type=resp.content_type)
                except UpstreamError as e:
                    self._failed(e)
            if pool is self.prefill:
                self.metrics.fallback_recompute.inc()
        return error_response(503, "no prefill or decode instance answered", "service_unavailable")

    async def _pipe(self, request: web.Request, b: Backend, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        out = await open_stream(request)
        try:
            async for data in resp.content.iter_any():
                await write(out, data)
        except (aiohttp.ClientError, TimeoutError) as e:
            self._failed(UpstreamError(f"{b.role}_stream", f"the {b.role} instance {b.url}: {type(e).__name__}"))
            await write(out, sse(error_body(f"the {b.role} instance failed the stream", "server_error", 503)))
            await write(out, SSE_DONE)
        return out

    async def _split_json(self, job: pr.Job) -> web.Response:
        n = pr.num_choices(job.body)
        tasks = [asyncio.ensure_future(self._json_choice(job, i)) for i in range(n)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                e = t.exception() if t.done() else None
                if isinstance(e, UpstreamError | Relayed):
                    return failure_response(e)
            results = [t.result() for t in tasks]
        finally:
            await cancel_all(tasks)
        usage = pr.usage_json(job.prompt_tokens or 0, sum(c for _, c in results))
        return web.json_response({**job.head(stream=False), "choices": [ch for ch, _ in results], "usage": usage})

    async def _json_choice(self, job: pr.Job, i: int) -> tuple[dict[str, Any], int]:
        pre = await self._prefill(job, i)
        if pre is None:
            choice, completion = await self._decode_json(job, pr.decode_body(job.body, i, False, None))
            return {**choice, "index": i}, completion
        if pre.kv_transfer_params is None:
            return pr.ended_choice(pre, i), pre.completion_tokens
        choice, completion = await self._decode_json(job, pr.decode_body(job.body, i, False, pre.kv_transfer_params))
        job.pinned.pop(i, None)  # D has it (and released it)
        return pr.merge_choice(pre, choice, job.chat, i), completion

    async def _split_stream(self, request: web.Request, job: pr.Job) -> web.StreamResponse:
        n = pr.num_choices(job.body)
        queue: asyncio.Queue[_Event] = asyncio.Queue(maxsize=_QUEUE_CHUNKS)
        tasks = [asyncio.ensure_future(self._stream_choice(job, i, queue)) for i in range(n)]
        out: web.StreamResponse | None = None
        completion, remaining = 0, n
        try:
            while remaining:
                ev = await queue.get()
                if isinstance(ev, _Done):
                    remaining, completion = remaining - 1, completion + ev.completion_tokens
                    continue
                if isinstance(ev, UpstreamError | Relayed):
                    if out is None:
                        return failure_response(ev)
                    err = ev.error if isinstance(ev, UpstreamError) else ev.error()
                    await write(out, sse({"error": err}))
                    await write(out, SSE_DONE)
                    return out
                out = out or await open_stream(request)
                await write(out, sse({**job.head(stream=True), "choices": [ev.choice]}))
            out = out or await open_stream(request)
            if pr.include_usage(job.body):
                usage = pr.usage_json(job.prompt_tokens or 0, completion)
                await write(out, sse({**job.head(stream=True), "choices": [], "usage": usage}))
            await write(out, SSE_DONE)
            return out
        finally:
            await cancel_all(tasks)

    async def _stream_choice(self, job: pr.Job, i: int, queue: asyncio.Queue[_Event]) -> None:
        try:
            pre = await self._prefill(job, i)
            if pre is None:
                completion = await self._decode_stream(job, i, pr.decode_body(job.body, i, True, None), queue, 0,
                                                       drop_role=False)
            else:
                await queue.put(_Chunk(pr.first_chunk_choice(pre, job.chat, i)))
                completion = pre.completion_tokens
                if pre.kv_transfer_params is not None:
                    body = pr.decode_body(job.body, i, True, pre.kv_transfer_params)
                    completion = await self._decode_stream(job, i, body, queue, len(pre.text), drop_role=job.chat)
                    job.pinned.pop(i, None)  # D has it (and released it)
            await queue.put(_Done(completion))
        except (UpstreamError, Relayed) as e:
            await queue.put(e)


@contextlib.asynccontextmanager
async def serve_proxy(config: ProxyConfig, host: str = "127.0.0.1", port: int = 0
                      ) -> AsyncIterator[tuple[str, Proxy]]:
    """Run the proxy in the current event loop; yields its base URL (``port`` 0: a free port) and state."""
    proxy = Proxy(config)
    runner = web.AppRunner(proxy.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield f"http://{bound_host}:{bound_port}", proxy
    finally:
        await runner.cleanup()
