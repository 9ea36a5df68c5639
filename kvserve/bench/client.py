"""One streamed OpenAI request (``/v1/completions`` or ``/v1/chat/completions``) and its timings.

Metric definitions (cost-model.md "Benchmarks"; as in vLLM's ``benchmark_serving``, with the ITL fix of
vllm-project/vllm#7242, our case BC-24):

* TTFT: request sent -> first content chunk (seconds).
* ITL: every gap between successive content chunks *after* the first; the TTFT gap is never an ITL sample.
  A chunk that carries ``k`` tokens (the server coalesced them) contributes ``k`` samples of ``gap / k``
  when the chunk says how many tokens it carries (``logprobs``, requested by default); tokens that arrive
  in the first chunk add zero gaps. Then ``len(itl) == output_tokens − 1``. Without per-chunk token
  counts, one sample per chunk gap (``itl_token_aligned`` False when that differs from the usage count).
* E2E: request sent -> last byte of the stream. TPOT (per request) = (E2E − TTFT) / (output_tokens − 1).
* Output tokens: the server's ``usage.completion_tokens`` (``stream_options.include_usage``), not chunks.

Keep-alive: the client reuses idle connections, and a server may close one just as a request is written on
it (llama.cpp's server closes idle keep-alive connections; the client then sees ``ServerDisconnectedError``
before any response byte). That is the client's own race, not a server failure, so a request that fails
this way on a *reused* connection is sent once more on a fresh connection (``retried``; its timings start
at the retry). A request whose fresh connection is dropped fails as before.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, on uvloop's event loop where uvloop is installed (a kvserve dependency on Linux and
    macOS), else on asyncio's own.

    Why: the client shares the host with the server it measures, and every streamed chunk costs it an event-loop
    wake-up. One 256-token stream at a time from ``send_request``, this host (2-vCPU Zen 4): 0.20-0.22 ms of
    client CPU per token on uvloop against 0.24-0.25 ms on asyncio's loop (docs/performance-log.md, s45)."""
    if importlib.util.find_spec("uvloop") is not None:
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


@dataclass
class RequestInput:
    """What to send. ``prompt`` is text or token ids (completions) or a message list (chat)."""

    api: str  # "completions" | "chat"
    base_url: str
    model: str
    prompt: str | list[int] | list[dict[str, str]]
    max_tokens: int
    ignore_eos: bool = True
    logprobs: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    endpoint: str | None = None  # the URL path (vLLM's --endpoint); None: /v1/completions or /v1/chat/completions


@dataclass
class RequestResult:
    """Timings of one request; seconds relative to ``start`` (``time.perf_counter``).

    Attributes:
        itl: inter-token latencies in seconds, TTFT excluded (see the module docstring).
        output_tokens: from the server's usage; falls back to the counted tokens when there is no usage.
        chunk_times: arrival time of each content chunk minus ``start`` (seconds).
    """

    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    itl_token_aligned: bool = False
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)
    retried: bool = False

    @property
    def tpot(self) -> float | None:
        """(E2E − TTFT) / (output_tokens − 1) seconds; None for a failed request or a single output token."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def request_body(inp: RequestInput) -> tuple[str, dict[str, Any]]:
    """The URL and JSON body of a streamed request with usage (and per-chunk token counts via logprobs)."""
    body: dict[str, Any] = {"model": inp.model, "max_tokens": inp.max_tokens, "temperature": inp.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if inp.ignore_eos:
        body["ignore_eos"] = True
    if inp.api == "chat":
        url = inp.base_url.rstrip("/") + (inp.endpoint or "/v1/chat/completions")
        body["messages"] = inp.prompt
        if inp.logprobs:
            body["logprobs"], body["top_logprobs"] = True, 0
    else:
        url = inp.base_url.rstrip("/") + (inp.endpoint or "/v1/completions")
        body["prompt"] = inp.prompt
        if inp.logprobs:
            body["logprobs"] = 0
    return url, body


def _chunk_content(choice: dict[str, Any], api: str) -> tuple[str, int | None]:
    """(text, number of tokens the chunk carries if it says so) of one streamed choice."""
    lp = choice.get("logprobs")
    if api == "chat":
        text = (choice.get("delta") or {}).get("content") or ""
        n = len(lp["content"]) if isinstance(lp, dict) and isinstance(lp.get("content"), list) else None
    else:
        text = choice.get("text") or ""
        n = len(lp["tokens"]) if isinstance(lp, dict) and isinstance(lp.get("tokens"), list) else None
    return text, n


def timings_from_chunks(times: list[float], counts: list[int | None]) -> tuple[float, list[float], bool]:
    """(TTFT, ITL samples, token-aligned) from content-chunk arrival times (relative to the send, seconds).

    ``counts[i]``: tokens in chunk ``i`` or None when unknown (taken as 1). Example: times [0.5, 0.53],
    counts [1, 3] -> TTFT 0.5, ITL [0.01, 0.01, 0.01]. Counts [2, 1] -> ITL [0.0, 0.03].

    Raises:
        ValueError: no chunks.
    """
    if not times:
        raise ValueError("no content chunks")
    known = all(c is not None for c in counts)
    k0 = counts[0] or 1
    itl = [0.0] * (k0 - 1)  # tokens that came with the first chunk: no wait after the first token
    for prev, t, c in zip(times, times[1:], counts[1:], strict=False):
        k = c or 1
        itl.extend([(t - prev) / k] * k)
    return times[0], itl, known


def connection_trace() -> aiohttp.TraceConfig:
    """A trace config that tells :func:`send_request` whether its connection was reused (pass it to the
    ``ClientSession`` as ``trace_configs=[connection_trace()]``)."""
    trace = aiohttp.TraceConfig()

    async def on_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
        attempt = ctx.trace_request_ctx
        if isinstance(attempt, SimpleNamespace):
            attempt.reused = True

    async def on_create(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: Any) -> None:
        attempt = ctx.trace_request_ctx
        if isinstance(attempt, SimpleNamespace):
            attempt.reused = False

    trace.on_connection_reuseconn.append(on_reuse)
    trace.on_connection_create_end.append(on_create)
    return trace


class _StaleConnection(Exception):
    """The server closed a reused keep-alive connection before sending any response byte."""


async def send_request(session: aiohttp.ClientSession, inp: RequestInput, t0: float) -> RequestResult:
    """Send one streamed request; never raises for HTTP or stream errors (they land in ``error``).

    A request that meets a closed keep-alive connection is retried once on a fresh one (module docstring).

    Args:
        t0: the run's origin (``time.perf_counter``); ``RequestResult.start`` is relative to it.
    """
    try:
        return await _send(session, inp, t0, RequestResult())
    except _StaleConnection:
        fresh = aiohttp.ClientSession(timeout=session.timeout, connector=aiohttp.TCPConnector(force_close=True))
        async with fresh:
            return await _send(fresh, inp, t0, RequestResult(retried=True))


async def _send(session: aiohttp.ClientSession, inp: RequestInput, t0: float, res: RequestResult) -> RequestResult:
    """One attempt of :func:`send_request`; raises _StaleConnection (only) for a closed reused connection."""
    url, body = request_body(inp)
    headers = {"Authorization": f"Bearer {inp.api_key}"} if inp.api_key else {}
    times: list[float] = []
    counts: list[int | None] = []
    texts: list[str] = []
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    res.start = start - t0
    attempt = SimpleNamespace(reused=None)  # None: unknown (a session without connection_trace())
    try:
        try:
            resp_cm = await session.post(url, json=body, headers=headers, trace_request_ctx=attempt)
        except aiohttp.ClientConnectorError:
            raise  # no connection at all (refused, unknown host): not a stale one
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if attempt.reused is not False and not res.retried:
                raise _StaleConnection from e
            raise
        async with resp_cm as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    for line in ev.split(b"\n"):
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        obj = json.loads(payload)
                        if "error" in obj:
                            res.error = f"stream error: {obj['error']}"
                            return res
                        if obj.get("usage"):
                            usage = obj["usage"]
                        for choice in obj.get("choices") or []:
                            text, n = _chunk_content(choice, inp.api)
                            if text or n:
                                times.append(now - start)
                                counts.append(n)
                                texts.append(text)
        res.e2e = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not times:
        res.error = "no content chunk received"
        return res
    res.ttft, res.itl, aligned = timings_from_chunks(times, counts)
    res.chunk_times, res.text = times, "".join(texts)
    if usage is not None:
        res.usage_reported = True
        res.output_tokens = int(usage.get("completion_tokens", 0))
        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
    else:
        res.output_tokens = len(res.itl) + 1
    res.itl_token_aligned = aligned and len(res.itl) == res.output_tokens - 1
    res.success = True
    return res
