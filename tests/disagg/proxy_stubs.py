"""Stub prefill (P) and decode (D) instances for the proxy's tests: aiohttp apps on free loopback ports that
speak the contract of ``kvserve/disagg/protocol.py``, with outputs known in advance.

Token ``k`` of a choice (0-based over the whole completion) has text ``" s{seed}t{k}"`` (``" t{k}"`` without a
seed), id ``100 + k`` and logprob ``-(k + 1) / 4``; a plain request's choice ``j`` uses ``seed + j`` (as the
engine does). A prompt has one token per word. A stop string ends a choice at the token whose text it is
(``finish_reason`` "stop", ``stop_reason`` the string, the token not in the text); else ``max_tokens``
(chat: ``max_completion_tokens`` first; default 16) does ("length").

P: a request with ``kv_transfer_params: {"do_remote_decode": true}`` answers one token and the RemotePrefill
dict (``remote_port`` is the stub's ZMQ ROUTER, which answers a Release with ``Released(found=True)`` and
records it), or null when that token met a stop string. D: a request with a RemotePrefill continues after
its ``first_token_ids`` (usage counts them); without one it generates the whole completion (recompute).
Every request's body is recorded; ``gate`` holds D's answer until set; a handler cancelled because the proxy
closed the connection is recorded too. ``/health`` and ``/metrics`` (``kvserve:num_requests_running`` /
``..._waiting``) answer as configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

from kvserve.disagg.protocol import DECODER, ENCODER, Release, Released

MODEL = "stub-model"


def token_text(seed: Any, k: int) -> str:
    return f" s{seed}t{k}" if isinstance(seed, int) else f" t{k}"


@dataclass
class Stub:
    """One stub instance: its settings (change them any time) and what it saw."""

    role: str  # "prefill" | "decode"
    # "ok" | "error500" | "drop" (close without answering) | "hang" (never answer) | "drop_mid_stream" |
    # "error_event" (an error event after the first token) | "no_kv" (P: no kv_transfer_params, as a P
    # without a kv_producer config)
    mode: str = "ok"
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    gate: asyncio.Event | None = None
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    contacted: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    released: list[str] = field(default_factory=list)
    released_event: asyncio.Event = field(default_factory=asyncio.Event)
    zmq_port: int = 0
    shutdown_timeout_s: float = 60.0  # how long stop() lets handlers finish before it closes their connections
    _runner: web.AppRunner | None = None
    _pinned: int = 0

    # ---- generation ------------------------------------------------------------------------------
    def _choices(self, body: dict[str, Any], start: int) -> list[tuple[list[str], str, str | None, int]]:
        """Per choice: (token texts, finish_reason, stop_reason, index after the last generated token)."""
        out = []
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        for j in range(body.get("n") or 1):
            seed = body.get("seed")
            seed = seed + j if isinstance(seed, int) else None
            toks: list[str] = []
            finish, reason, end = "length", None, body.get("max_completion_tokens") or body.get("max_tokens") or 16
            for k in range(start, end):
                t = token_text(seed, k)
                if t in stop:
                    finish, reason, end = "stop", t, k + 1
                    break
                toks.append(t)
            out.append((toks, finish, reason, end))
        return out

    @staticmethod
    def _logprobs(toks: list[str], start: int, chat: bool, offset0: int = 0) -> dict[str, Any]:
        lps = [-(start + m + 1) / 4 for m in range(len(toks))]
        if chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(toks, lps, strict=True)]}
        offsets, pos = [], offset0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        tops = [{t: lp} for t, lp in zip(toks, lps, strict=True)]
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def _answer(self, request: web.Request, body: dict[str, Any], chat: bool, start: int,
                      prompt_tokens: int, extra: dict[str, Any] | None = None) -> web.StreamResponse:
        choices = self._choices(body, start)
        want_lp = body.get("logprobs") is not None and body.get("logprobs") is not False
        completion = sum(end for *_, end in choices)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": f"stub-{self.role}", "object": obj, "created": 1, "model": MODEL}
        if not body.get("stream"):
            out = []
            for j, (toks, finish, reason, _) in enumerate(choices):
                text = "".join(toks)
                ch: dict[str, Any] = {"index": j, "logprobs": self._logprobs(toks, start, chat) if want_lp else None,
                                      "finish_reason": finish, "stop_reason": reason}
                if chat:
                    ch["message"] = {"role": "assistant", "content": text}
                else:
                    ch["text"] = text
                out.append(ch)
            return web.json_response({**head, "choices": out, "usage": usage, **(extra or {})})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head["object"] = "chat.completion.chunk" if chat else "text_completion"

        async def send(choice: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode())

        if chat:
            for j in range(len(choices)):
                await send({"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})
        for j, (toks, finish, reason, _) in enumerate(choices):
            pos = 0
            for m, t in enumerate(toks):
                last = m == len(toks) - 1
                lp = self._logprobs([t], start + m, chat, pos) if want_lp else None
                pos += len(t)
                piece: dict[str, Any] = {"delta": {"content": t}} if chat else {"text": t}
                await send({"index": j, **piece, "logprobs": lp, "finish_reason": finish if last else None,
                            "stop_reason": reason if last else None})
                await asyncio.sleep(0)
                if self.mode == "drop_mid_stream" and request.transport is not None:
                    request.transport.close()
                    return resp
                if self.mode == "error_event":
                    await resp.write(b'data: {"error": {"message": "stub engine failure", "type": "internal_error",'
                                     b' "param": null, "code": 500}}\n\ndata: [DONE]\n\n')
                    return resp
            if not toks:
                piece = {"delta": {"content": ""}} if chat else {"text": ""}
                await send({"index": j, **piece, "logprobs": None, "finish_reason": finish, "stop_reason": reason})
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- routes ----------------------------------------------------------------------------------
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.paths.append(request.path)
        self.contacted.set()
        chat = request.path.endswith("/chat/completions")
        if self.mode == "error500":
            return web.json_response({"error": {"message": "stub overloaded", "type": "internal_error",
                                                "param": None, "code": 500}}, status=500)
        if self.mode == "drop" and request.transport is not None:
            request.transport.close()
            return web.Response()
        if self.mode == "hang":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if "bogus" in body:
            return web.json_response({"error": {"message": "bogus: Extra inputs are not permitted",
                                                "type": "invalid_request_error", "param": "bogus", "code": 400}},
                                     status=400)
        if chat:
            prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        else:
            p = body["prompt"]
            p = p[0] if isinstance(p, list) and p and isinstance(p[0], str) else p
            prompt_tokens = len(p.split()) if isinstance(p, str) else len(p)
        kv = body.get("kv_transfer_params")
        if self.role == "prefill" and kv == {"do_remote_decode": True}:
            assert body["max_tokens"] == 1 and body.get("n") == 1 and not body.get("stream"), body
            toks, *_ = self._choices(body, 0)[0]
            self._pinned += 1
            params = None if not toks else {
                "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": self.zmq_port,
                "remote_request_id": f"stub-p-{self._pinned}", "remote_engine_id": "stub-p",
                "num_prompt_tokens": prompt_tokens, "first_token_ids": [100]}
            extra = {} if self.mode == "no_kv" else {"kv_transfer_params": params}
            return await self._answer(request, body, chat, 0, prompt_tokens, extra)
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if self.role == "decode" and isinstance(kv, dict) and kv.get("do_remote_prefill"):
            return await self._answer(request, body, chat, len(kv["first_token_ids"]), kv["num_prompt_tokens"])
        return await self._answer(request, body, chat, 0, prompt_tokens)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = []
        for name, value in (("running", self.running), ("waiting", self.waiting)):
            lines += [f"# HELP kvserve:num_requests_{name} Sequences {name}.",
                      f"# TYPE kvserve:num_requests_{name} gauge",
                      f'kvserve:num_requests_{name}{{model_name="{MODEL}"}} {value}']
        return web.Response(text="\n".join(lines) + "\n")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                              "owned_by": f"stub-{self.role}"}]})

    async def _zmq_router(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            ident, *_, payload = await sock.recv_multipart()
            msg = DECODER.decode(payload)
            if isinstance(msg, Release):
                self.released.append(msg.request_id)
                self.released_event.set()
                await sock.send_multipart([ident, ENCODER.encode(Released(found=True))])

    # ---- lifecycle -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def serve(self, port: int = 0) -> AsyncIterator[Stub]:
        """Serve on ``port`` (0: a free one; a stopped stub's port brings it back at the same URL)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self.zmq_port = sock.bind_to_random_port("tcp://127.0.0.1")
        router = asyncio.ensure_future(self._zmq_router(sock))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self.shutdown_timeout_s)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        try:
            yield self
        finally:
            router.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await router
            sock.close(linger=0)
            ctx.term()
            await self.stop()

    async def stop(self) -> None:
        """Stop serving HTTP (the port then refuses connections)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


@contextlib.asynccontextmanager
async def stubs(num_prefill: int = 1, num_decode: int = 1, **settings: Any) -> AsyncIterator[tuple[list[Stub],
                                                                                                  list[Stub]]]:
    """``num_prefill`` P and ``num_decode`` D stubs, serving; ``settings`` apply to all."""
    ps = [Stub("prefill", **settings) for _ in range(num_prefill)]
    ds = [Stub("decode", **settings) for _ in range(num_decode)]
    async with contextlib.AsyncExitStack() as stack:
        for s in ps + ds:
            await stack.enter_async_context(s.serve())
        yield ps, ds
