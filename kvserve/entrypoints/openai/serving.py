"""What the completion and chat handlers share: the server context, prompt checks, streams, SSE, usage.

Responses are built as plain dicts (no pydantic on the way out); stream chunks are encoded with msgspec (see
:func:`sse`), so 64 streaming clients do not make the HTTP side the bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from kvserve.engine.async_llm import AsyncLLM, RequestStream
from kvserve.entrypoints.openai.json_body import parse_json_object
from kvserve.entrypoints.openai.sse import SSE_DONE, sse  # noqa: F401 (re-exported to serving_*.py)
from kvserve.errors import InvalidRequestError, KVServeError, ModelNotFoundError, PromptTooLongError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("kvserve.requests")


class AuthenticationError(KVServeError):
    """Missing or wrong API key (HTTP 401)."""

    status_code = 401
    error_type = "authentication_error"


class PayloadTooLargeError(KVServeError):
    """The request body is larger than the server accepts (HTTP 413)."""

    status_code = 413
    error_type = "invalid_request_error"


class RequestFailedError(KVServeError):
    """The engine failed this request (an internal error confined to it; HTTP 500)."""


@dataclass
class ServerContext:
    """Everything a handler needs; one per server.

    Attributes:
        llm: the async engine.
        tokenizer: the server's own tokenizer instance (the engine thread has its own: a HF tokenizer must
            not be used from two threads at once), or None with ``--skip-tokenizer-init``.
        served_model_name: the name in ``/v1/models`` and in responses.
        model_aliases: names a request's ``model`` may have (served name and ``--model``).
        max_model_len: longest prompt + output in tokens.
        api_key: required bearer token for ``/v1/*`` (None: no auth).
        max_body_bytes: largest request body accepted.
        sampling_defaults: SamplingParams values for fields a request leaves out (``--generation-config``).
        log_requests: log every request's prompt and parameters at INFO (off: ``--disable-log-requests``).
        max_log_len: characters of a prompt shown in that log (None: all).
        tool_call_parser: the parser of ``tool_choice: auto`` outputs (``--tool-call-parser`` with
            ``--enable-auto-tool-choice``); None: ``auto`` is refused (400), as vLLM.
    """

    llm: AsyncLLM
    tokenizer: Tokenizer | None
    served_model_name: str
    model_aliases: frozenset[str]
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    log_requests: bool = True
    max_log_len: int | None = None
    tool_call_parser: str | None = None

    # ---- checks --------------------------------------------------------------------------------
    def check_auth(self, raw: Request) -> None:
        """Raises AuthenticationError unless ``Authorization: Bearer <api_key>`` matches."""
        if self.api_key is None:
            return
        given = raw.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            raise AuthenticationError("invalid or missing API key (send 'Authorization: Bearer <key>')")

    def check_model(self, model: str | None) -> None:
        """Raises ModelNotFoundError unless ``model`` is None or a served name."""
        if model is not None and model not in self.model_aliases:
            raise ModelNotFoundError(f"model: the model {model!r} does not exist; this server serves "
                                     f"{self.served_model_name!r}", param="model")

    async def read_json(self, raw: Request) -> Any:
        """The request body as JSON, read with a size limit.

        Raises:
            PayloadTooLargeError: body over ``max_body_bytes``.
            InvalidRequestError: not UTF-8, not JSON, not a JSON object, too deeply nested, or a string with
                a lone surrogate (see ``json_body``).
        """
        declared = raw.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise PayloadTooLargeError(f"body: {declared} bytes, the limit is {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in raw.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLargeError(f"body: more than {self.max_body_bytes} bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"body: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        return parse_json_object(text)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """Prompt -> (text or None, token ids).

        Raises:
            InvalidRequestError: text without a tokenizer.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt: text needs a tokenizer (--skip-tokenizer-init is set)",
                                          param="prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return None, prompt

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Messages -> prompt token ids through the model's chat template.

        Raises:
            InvalidRequestError: no tokenizer, or the template refused the messages (a template may raise on
                e.g. roles out of order; that is the client's input, never a 500).
        """
        if self.tokenizer is None:
            raise InvalidRequestError("messages: chat needs a tokenizer (--skip-tokenizer-init is set)",
                                      param="messages")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final_message, tools)
        except KVServeError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja errors from the model's own template
            raise InvalidRequestError(f"messages: the chat template refused them: {e}", param="messages") from None

    def truncate(self, ids: list[int], truncate_prompt_tokens: int | None, what: str = "prompt") -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last k prompt tokens (-1: the last ``max_model_len``).

        Raises:
            InvalidRequestError: k > ``max_model_len``.
        """
        k = truncate_prompt_tokens
        if k is None:
            return ids
        if k > self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens: {k} is more than max_model_len ({self.max_model_len})",
                                      param="truncate_prompt_tokens")
        return ids[-(self.max_model_len if k == -1 else k):]

    def log_request(self, request_id: str, prompts: Sequence[str | list[int]], params: SamplingParams) -> None:
        """vLLM's request log line (unless ``--disable-log-requests``); prompts cut to ``max_log_len``."""
        if not self.log_requests:
            return
        shown = [p[:self.max_log_len] if self.max_log_len is not None else p for p in prompts]
        logger.info("Received request %s: prompt: %r, params: %s", request_id, shown[0] if len(shown) == 1 else shown,
                    params)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "prompt") -> None:
        """vLLM's rule: prompt + max_tokens must fit ``max_model_len`` (400 stating the numbers).

        Raises:
            PromptTooLongError: it does not fit (``param`` is ``prompt``/``messages`` or ``max_tokens``).
        """
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptTooLongError(
                f"{what}: this model's maximum context length is {limit} tokens, but the {what} has "
                f"{num_prompt_tokens} tokens (no room for any output)", param=what)
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            total = num_prompt_tokens + max_tokens
            raise PromptTooLongError(
                f"max_tokens: this model's maximum context length is {limit} tokens, but {total} were "
                f"requested ({num_prompt_tokens} in the {what}, {max_tokens} for the completion)",
                param="max_tokens")

    def token_text(self, token_id: int) -> str:
        """One token as logprobs show it (``bytes:\\xf0\\x9f`` for part of a character; see
        ``Tokenizer.logprob_token``); ``token_id:N`` without a tokenizer."""
        return self.tokenizer.logprob_token(token_id) if self.tokenizer else f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to the text (those of a whole text are its tokens' bytes, joined)."""
        return self.tokenizer.token_bytes(token_id) if self.tokenizer else b""

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""

    # ---- engine requests -----------------------------------------------------------------------
    async def submit(self, prompts: Sequence[list[int]], params: SamplingParams, prefix: str, priority: int,
                     cache_salt: str | None) -> list[RequestStream]:
        """Add one engine request per prompt and wait until all are queued.

        Raises:
            InvalidRequestError, TooManyRequestsError, EngineDeadError: one was refused (the others are aborted).
        """
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = prefix if len(prompts) == 1 else f"{prefix}-{i}"
                streams.append(self.llm.add_request({"prompt_token_ids": ids}, params, rid, priority, cache_salt))
            for s in streams:
                await s.accepted()
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's ``continuous_usage_stats`` usage of a stream chunk: the tokens so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def check_failed(out: RequestOutput) -> None:
    """Raises RequestFailedError when the engine failed this request (finish_reason ``error``)."""
    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
        raise RequestFailedError(f"the engine failed this request: {out.error or 'internal error'}")


async def merged(streams: list[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Outputs of several streams as ``(stream index, output)`` in arrival order, until all finished.

    Leaving early (an exception, a cancelled consumer) aborts every stream that has not finished.
    """
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    await queue.put((i, out))
                await queue.put((i, None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.abort()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream, in stream order."""
    finals: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(merged(streams)) as outputs:
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
    return [finals[i] for i in range(len(streams))]


async def wait_disconnect(raw: Request) -> None:
    """Return when the client closed the connection (the body must already be read)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(raw: Request, work: asyncio.Future[Any] | Any) -> Any:
    """Await ``work`` (a coroutine) unless the client disconnects first: then cancel it and return None.

    Cancelling the work aborts its engine requests (see :func:`merged`), so their KV blocks are freed.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # the client is gone; nothing to report
        await task
    return None


def finite_logprob(v: float) -> float:
    """JSON has no -inf; OpenAI clients expect a number (-9999, as vLLM)."""
    return v if v > -1e30 else -9999.0
