"""The proxy's HTTP plumbing: one backend request with its failures typed, SSE in and out, OpenAI's error shape.
Torch-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvserve.disagg.proxy_backends import Backend, Pool
from kvserve.entrypoints.openai.sse import SSE_DONE, sse  # noqa: F401 (re-exported to proxy.py, router.py)

logger = logging.getLogger(__name__)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    """An HTTP error in OpenAI's shape (``code`` is the status)."""
    return web.json_response(error_body(message, err_type, status, param), status=status)


class UpstreamError(Exception):
    """A backend request that failed: connection, timeout, 5xx, a broken answer or stream.

    Attributes:
        kind: the failures metric's label (``prefill_timeout``, ``decode_http_5xx``, ...).
        unsent: the connection was never made, so the backend never saw the request (safe to send elsewhere).
        error: the error object for the client: a 503 ``server_error`` with the message.
    """

    def __init__(self, kind: str, message: str, unsent: bool = False) -> None:
        super().__init__(message)
        self.kind, self.message, self.unsent = kind, message, unsent
        self.error = error_body(message, "server_error", 503)["error"]


class Relayed(Exception):
    """A backend's 4xx, for the client as it is."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"HTTP {status}")
        self.status, self.body, self.content_type = status, body, content_type

    def error(self) -> dict[str, Any]:
        """The error object inside the body (one made from the text when it has none)."""
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            data = json.loads(self.body)
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                return dict(data["error"])
        return error_body(self.body.decode("utf-8", "replace")[:500], "invalid_request_error", self.status)["error"]


class ClientGone(Exception):
    """Writing to the client failed: it closed the connection."""


def failure_response(e: UpstreamError | Relayed) -> web.Response:
    """What a client gets for a failure before anything was sent to it: the relayed 4xx, or a 503."""
    if isinstance(e, Relayed):
        return web.Response(body=e.body, status=e.status, content_type=e.content_type)
    return web.json_response({"error": e.error}, status=503)


@contextlib.asynccontextmanager
async def upstream(session: aiohttp.ClientSession, pool: Pool, backend: Backend, method: str, path: str,
                   body: dict[str, Any] | None, headers: dict[str, str], timeout: aiohttp.ClientTimeout,
                   data: bytes | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
    """One request to a backend, counted in its in-flight load while it lasts: ``body`` as JSON, or ``data``
    (bytes sent as they are, as ``application/json``) when given.

    Leaving the block by an exception (a cancel included) closes the connection, so the backend aborts the
    request.

    Raises:
        UpstreamError: aiohttp's errors: ``<role>_timeout`` (``timeout.total`` passed), ``<role>_connect`` (no
            connection: ``unsent``; or a dropped one; both mark the backend unhealthy), ``<role>_stream``
            (a broken response).
    """
    role = backend.role
    backend.inflight += 1
    try:
        if data is not None:
            headers = {**headers, "Content-Type": "application/json"}
        async with session.request(method, backend.url + path, json=body if data is None else None, data=data,
                                   headers=headers, timeout=timeout) as resp:
            try:
                yield resp
            except BaseException:
                resp.close()
                raise
    except TimeoutError:
        raise UpstreamError(f"{role}_timeout", f"the {role} instance {backend.url} did not answer within "
                                               f"{timeout.total:g} s") from None
    except aiohttp.ClientConnectorError as e:
        pool.set_health(backend, False, str(e))
        raise UpstreamError(f"{role}_connect", f"the {role} instance {backend.url} is unreachable: {e}",
                            unsent=True) from None
    except aiohttp.ClientConnectionError as e:
        pool.set_health(backend, False, f"{type(e).__name__}: {e}")
        raise UpstreamError(f"{role}_connect", f"the {role} instance {backend.url} dropped the connection: "
                                               f"{type(e).__name__}: {e}") from None
    except aiohttp.ClientError as e:
        raise UpstreamError(f"{role}_stream", f"the {role} instance {backend.url}: {type(e).__name__}: {e}") from None
    finally:
        backend.inflight -= 1


async def http_error(backend: Backend, resp: aiohttp.ClientResponse) -> Relayed | UpstreamError:
    """A non-200 answer: a 4xx to relay, else an ``<role>_http_5xx`` failure (the body read)."""
    raw = await resp.read()
    if 400 <= resp.status < 500:
        return Relayed(resp.status, raw, resp.content_type)
    return UpstreamError(f"{backend.role}_http_5xx", f"the {backend.role} instance {backend.url} answered "
                                                     f"{resp.status}: {raw[:300].decode('utf-8', 'replace')}")


async def sse_events(resp: aiohttp.ClientResponse, role: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE response until ``data: [DONE]``.

    Raises:
        UpstreamError: the stream ended before ``[DONE]`` (``<role>_stream``) or an event is not a JSON object
            (``<role>_bad_response``).
    """
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            obj = json_or_none(payload)
            if not isinstance(obj, dict):
                raise UpstreamError(f"{role}_bad_response", f"the {role} instance {resp.url.origin()} streamed a "
                                                            "malformed event")
            yield obj
    raise UpstreamError(f"{role}_stream", f"the {role} instance {resp.url.origin()} ended its stream early")


def json_or_none(raw: bytes) -> Any:
    """``raw`` parsed as JSON; None when it is not JSON.

    msgspec first (a streamed event per token goes through here), then ``json.loads`` for what msgspec refuses
    and Python's json accepts (``NaN`` / ``Infinity`` literals, integers beyond 64 bits), so the result is
    ``json.loads``'s."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        pass
    try:
        return json.loads(raw)
    except ValueError:
        return None


def auth_headers(request: web.Request) -> dict[str, str]:
    """The client headers the backends see: its ``Authorization`` (their ``--api-key``)."""
    value = request.headers.get("Authorization")
    return {"Authorization": value} if value is not None else {}


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Start an SSE response. Raises ClientGone."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await out.prepare(request)
    except ConnectionResetError:
        raise ClientGone from None
    return out


async def write(out: web.StreamResponse, data: bytes) -> None:
    """Write to the client. Raises ClientGone (never aiohttp's errors, which name a backend's failures)."""
    try:
        await out.write(data)
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError too
        raise ClientGone from None


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they are done."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                            ) -> web.StreamResponse:
    """Every error in OpenAI's shape; never a traceback to the client."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err_type = "not_found_error" if e.status == 404 else "invalid_request_error"
        return error_response(e.status, f"{request.method} {request.path}: {e.reason}", err_type)
    except Exception as e:  # noqa: BLE001 - logged; the client gets a 500 in OpenAI's shape
        logger.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}", "internal_error")
