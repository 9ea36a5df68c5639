"""A stub OpenAI SSE server with known delays (aiohttp.web on a free loopback port), for benchmark tests.

The first chunk comes ``first_delay_s`` after the request; then one chunk every ``tokens_per_chunk ×
token_gap_s`` carrying ``tokens_per_chunk`` tokens (and, when the request asks for logprobs and
``send_logprobs`` is set, one logprobs entry per token, as a real server does); then the usage chunk
(``completion_tokens`` = ``max_tokens``) and ``[DONE]``. Used by tests/bench and tests/cases (BC-24).

``drop_connections``: ``"reused"`` closes a keep-alive connection, without a response, when a second request
arrives on it (what a client meets when a server such as llama.cpp's closes an idle keep-alive connection
while the request is on its way); ``"all"`` drops every request so. ``StubStats`` counts both.

It runs in the test's own event loop (no GIL hand-offs between client and server threads).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web


@dataclass
class StubConfig:
    first_delay_s: float = 0.5
    token_gap_s: float = 0.010
    tokens_per_chunk: int = 1
    send_logprobs: bool = True
    send_usage: bool = True
    drop_connections: str | None = None  # None | "reused" | "all"


@dataclass
class StubStats:
    """What the stub saw: requests answered and requests dropped by closing their connection."""

    answered: int = 0
    dropped: int = 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _event(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _app(cfg: StubConfig, stats: StubStats) -> web.Application:
    # every transport that carried a request, held (not its id(): CPython reuses the id of a freed transport,
    # which made a fresh connection look reused and get dropped)
    seen: list[object] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        transport = request.transport
        reused = any(t is transport for t in seen)
        if not reused:
            seen.append(transport)
        if transport is not None and not body.get("stub_warmup") and (
                cfg.drop_connections == "all" or (cfg.drop_connections == "reused" and reused)):
            stats.dropped += 1
            transport.close()  # no response byte: the client sees ServerDisconnectedError
            return web.Response()
        stats.answered += 1
        chat = request.path.endswith("/chat/completions")
        n = int(body["max_tokens"])
        lp = body.get("logprobs")  # completions: an int (0 counts), chat: a bool
        want_lp = lp is not None and lp is not False and cfg.send_logprobs
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        first_delay = 0.0 if body.get("stub_warmup") else cfg.first_delay_s
        sent = 0
        while sent < n:
            k = min(cfg.tokens_per_chunk, n - sent)
            # absolute schedule: no drift from sleep overshoot
            due = start + first_delay + (sent + k - 1) * cfg.token_gap_s
            await asyncio.sleep(max(0.0, due - loop.time()))
            toks = [f" t{sent + j}" for j in range(k)]
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": "".join(toks)}}
                if want_lp:
                    choice["logprobs"] = {"content": [{"token": t, "logprob": 0.0} for t in toks]}
            else:
                choice = {"index": 0, "text": "".join(toks)}
                if want_lp:
                    choice["logprobs"] = {"tokens": toks, "token_logprobs": [0.0] * k}
            sent += k
            choice["finish_reason"] = "length" if sent == n else None
            await resp.write(_event({"id": "x", "choices": [choice]}))
        if cfg.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(_event({"id": "x", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                                         "total_tokens": n + 7}}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    return app


@asynccontextmanager
async def stub_server(cfg: StubConfig, stats: StubStats | None = None) -> AsyncIterator[str]:
    """Run the stub in the current event loop (after a short warm-up); yields its base URL."""
    runner = web.AppRunner(_app(cfg, stats or StubStats()), access_log=None)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await _warm(f"http://127.0.0.1:{port}/v1/completions")
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _warm(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(url, json={"max_tokens": 1, "stub_warmup": True}) as r:
                await r.read()
