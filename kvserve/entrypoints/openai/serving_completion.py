"""``POST /v1/completions``: one engine request per prompt, ``n`` choices each, streamed or not.

Choice ``k`` of prompt ``i`` has index ``i * n + k`` (OpenAI's order). The engine's outputs are cumulative,
so a streamed delta is the text (and logprobs) beyond what this choice already sent; the concatenated
deltas therefore equal the non-streamed text.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_llm import RequestStream
from kvserve.entrypoints.openai.completion_logprobs import CompletionLogprobs, prompt_logprobs_json
from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.serving import (
    SSE_DONE,
    ServerContext,
    check_failed,
    final_outputs,
    merged,
    new_id,
    now_s,
    running_usage,
    sse,
    unless_disconnected,
    usage,
)
from kvserve.entrypoints.openai.structured import check_compiles
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.outputs import CompletionOutput, RequestOutput

_CLIENT_CLOSED = 499  # nginx's code for "client closed the request"; never seen by the client


@dataclass
class _Sent:
    """What one streamed choice already sent."""

    text_len: int = 0
    logprobs: CompletionLogprobs | None = None
    echoed: bool = False
    finished: bool = False


async def create_completion(ctx: ServerContext, raw: Request, req: CompletionRequest) -> Response:
    """Run a completion request; raises KVServeError subclasses for every 4xx."""
    req.check_unsupported()
    ctx.check_model(req.model)
    encoded = []
    for text, ids in (ctx.encode(p) for p in req.prompts()):
        kept = ctx.truncate(ids, req.truncate_prompt_tokens)
        encoded.append((text if len(kept) == len(ids) else None, kept))  # a cut prompt echoes its tokens
    for _, ids in encoded:
        ctx.check_length(len(ids), req.max_tokens)
    params = req.sampling_params(req.max_tokens, req.logprobs, ctx.sampling_defaults)
    if req.kv_transfer_params is not None and len(encoded) > 1:
        raise InvalidRequestError("kv_transfer_params: one prompt per request (this one has "
                                  f"{len(encoded)})", param="kv_transfer_params")
    await check_compiles(ctx.llm.engine.structured_outputs, params.structured_outputs)
    request_id = new_id("cmpl")
    ctx.log_request(request_id, [text if text is not None else ids for text, ids in encoded], params)
    streams = await ctx.submit([ids for _, ids in encoded], params, request_id, req.priority, req.cache_salt)
    echoes = [(text if text is not None else ctx.decode(ids)) if req.echo else "" for text, ids in encoded]
    num_prompt_tokens = sum(len(ids) for _, ids in encoded)
    if req.stream:
        gen = _stream(ctx, req, request_id, streams, echoes, num_prompt_tokens)
        return StreamingResponse(gen, media_type="text/event-stream")
    outs = await unless_disconnected(raw, final_outputs(streams))
    if outs is None:
        return Response(status_code=_CLIENT_CLOSED)
    for out in outs:
        check_failed(out)
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            text = echoes[i] + c.text
            builder = _logprobs_builder(ctx, req, echoes[i], out.prompt_token_ids)
            lps = builder.update(c.logprobs, out.prompt_logprobs, len(text), finished=True) if builder else None
            choice = {"index": i * req.n + c.index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if params.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
            choices.append(choice)
    choices.sort(key=lambda ch: ch["index"])
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": now_s(), "model": ctx.served_model_name,
        "choices": choices, "usage": _usage(outs, num_prompt_tokens),
        **({"kv_transfer_params": outs[0].kv_transfer_params} if req.kv_transfer_params is not None else {})})


def _usage(outs: list[RequestOutput], num_prompt_tokens: int) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return usage(num_prompt_tokens, completion, sum(o.num_cached_tokens for o in outs))


def _logprobs_builder(ctx: ServerContext, req: CompletionRequest, echo: str,
                      prompt_ids: list[int]) -> CompletionLogprobs | None:
    """The logprobs builder of one choice (None without ``logprobs``); with echo it shows the prompt's too."""
    if req.logprobs is None:
        return None
    special = frozenset(ctx.tokenizer.hf.all_special_ids) if ctx.tokenizer and req.skip_special_tokens else frozenset()
    return CompletionLogprobs(ctx, echo, prompt_ids if req.echo else None, special)


async def _stream(ctx: ServerContext, req: CompletionRequest, request_id: str, streams: list[RequestStream],
                  echoes: list[str], num_prompt_tokens: int) -> AsyncIterator[bytes]:
    created, n = now_s(), req.n
    sent = [_Sent() for _ in range(len(streams) * n)]
    finals: dict[int, RequestOutput] = {}
    head = {"id": request_id, "object": "text_completion", "created": created, "model": ctx.served_model_name}
    continuous = req.include_usage and req.stream_options is not None and req.stream_options.continuous_usage_stats
    generated = [0] * len(streams)  # tokens so far per prompt (continuous_usage_stats)
    try:
        async with contextlib.aclosing(merged(streams)) as outputs:
            async for i, out in outputs:
                check_failed(out)
                choices = [ch for c in out.outputs if (ch := _delta(ctx, req, sent[i * n + c.index], c, out,
                                                                    i * n + c.index, echoes[i])) is not None]
                generated[i] = sum(len(c.token_ids) for c in out.outputs)
                if choices:
                    extra = {"usage": running_usage(num_prompt_tokens, sum(generated))} if continuous else {}
                    yield sse({**head, "choices": choices, **extra})
                if out.finished:
                    finals[i] = out
        if req.include_usage:
            outs = [finals[i] for i in range(len(streams))]
            yield sse({**head, "choices": [], "usage": _usage(outs, num_prompt_tokens)})
    except KVServeError as e:
        yield sse({"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": e.status_code}})
    finally:
        for s in streams:
            s.abort()
    yield SSE_DONE


def _delta(ctx: ServerContext, req: CompletionRequest, st: _Sent, c: CompletionOutput, out: RequestOutput,
           index: int, echo: str) -> dict[str, Any] | None:
    if st.finished:
        return None
    prefix = ""
    if not st.echoed:
        prefix, st.echoed = echo, True
        st.logprobs = _logprobs_builder(ctx, req, echo, out.prompt_token_ids)
    new_text = c.text[st.text_len:]
    st.text_len = len(c.text)
    st.finished = c.finish_reason is not None
    # Logprobs go out once the text up to their offset was sent (text_offset equals the non-streamed one).
    lps = st.logprobs.update(c.logprobs, out.prompt_logprobs, len(echo) + st.text_len, st.finished) \
        if st.logprobs else None
    text = prefix + new_text
    if not text and lps is None and not st.finished:
        return None
    return {"index": index, "text": text, "logprobs": lps, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}
