"""``POST /v1/chat/completions``: the model's chat template, ``n`` choices, streamed or not.

A stream opens every choice with ``{"role": "assistant", "content": ""}``, then sends content deltas; the
chunk that finishes a choice carries its ``finish_reason``. With ``stream_options.include_usage`` one more
chunk follows with ``choices: []`` and the usage, then ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_llm import RequestStream
from kvserve.engine.llm_engine import check_num_logprobs
from kvserve.entrypoints.openai.completion_logprobs import prompt_logprobs_json
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.serving import (
    SSE_DONE,
    ServerContext,
    check_failed,
    final_outputs,
    finite_logprob,
    merged,
    new_id,
    now_s,
    running_usage,
    sse,
    unless_disconnected,
    usage,
)
from kvserve.entrypoints.openai.structured import check_compiles
from kvserve.entrypoints.openai.tool_calls import ToolCallPlan, assistant_message, with_tool_constraint
from kvserve.errors import KVServeError
from kvserve.outputs import CompletionOutput, RequestOutput

_CLIENT_CLOSED = 499


async def create_chat_completion(ctx: ServerContext, raw: Request, req: ChatCompletionRequest) -> Response:
    """Run a chat request; raises KVServeError subclasses for every 4xx."""
    req.check_unsupported()
    ctx.check_model(req.model)
    plan = ToolCallPlan(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_call_parser)
    ids = ctx.apply_chat_template(req.template_messages(), req.add_generation_prompt, req.continue_final_message,
                                  plan.template_tools())
    ids = ctx.truncate(ids, req.truncate_prompt_tokens)
    max_tokens = req.effective_max_tokens
    ctx.check_length(len(ids), max_tokens, what="messages")
    params = req.sampling_params(max_tokens, req.num_logprobs, ctx.sampling_defaults)
    engine = ctx.llm.engine
    check_num_logprobs(req.top_logprobs, engine.config.max_logprobs, engine.arch.vocab_size, "top_logprobs")
    params = with_tool_constraint(params, plan)
    await check_compiles(ctx.llm.engine.structured_outputs, params.structured_outputs)
    request_id = new_id("chatcmpl")
    ctx.log_request(request_id, [ids], params)
    streams = await ctx.submit([ids], params, request_id, req.priority, req.cache_salt)
    if req.stream:
        return StreamingResponse(_stream(ctx, req, plan, request_id, streams[0], len(ids)),
                                 media_type="text/event-stream")
    outs = await unless_disconnected(raw, final_outputs(streams))
    if outs is None:
        return Response(status_code=_CLIENT_CLOSED)
    out = outs[0]
    check_failed(out)
    choices = []
    for c in out.outputs:
        message, finish_reason = assistant_message(plan, req.echo_text + c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message,
                        "logprobs": _logprobs(ctx, c, 0) if req.logprobs else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": now_s(), "model": ctx.served_model_name,
        "choices": choices, "usage": _usage(out),
        **({"prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)} if params.prompt_logprobs is not None
           else {}),
        **({"kv_transfer_params": out.kv_transfer_params} if req.kv_transfer_params is not None else {})})


def _usage(out: RequestOutput) -> dict[str, Any]:
    return usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)


def _logprobs(ctx: ServerContext, c: CompletionOutput, start: int) -> dict[str, Any]:
    """OpenAI's chat logprobs object for ``c.logprobs[start:]``. ``bytes`` are the token's own bytes (part of
    a character for a split emoji, whose ``token`` reads ``bytes:\\xf0\\x9f``), so they join into the text's."""
    content = []
    for lp in (c.logprobs or [])[start:]:
        if lp is not None:
            content.append({**_entry(ctx, lp.token_id, lp.logprob),
                            "top_logprobs": [_entry(ctx, t, v) for t, v in lp.top]})
    return {"content": content}


def _entry(ctx: ServerContext, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": ctx.token_text(token_id), "logprob": finite_logprob(logprob),
            "bytes": list(ctx.token_bytes(token_id))}


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, plan: ToolCallPlan, request_id: str,
                  stream: RequestStream, num_prompt_tokens: int) -> AsyncIterator[bytes]:
    head = {"id": request_id, "object": "chat.completion.chunk", "created": now_s(), "model": ctx.served_model_name}
    n = req.n
    text_len, num_lps, done = [0] * n, [0] * n, [False] * n
    streamers = [plan.streamer() for _ in range(n)]  # content and tool_calls deltas per choice
    continuous = req.include_usage and req.stream_options is not None and req.stream_options.continuous_usage_stats
    # vLLM's continuous_usage_stats: every chunk carries the usage so far, the opening ones too
    opening = {"usage": running_usage(num_prompt_tokens, 0)} if continuous else {}
    final: RequestOutput | None = None
    try:
        yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None} for i in range(n)], **opening})
        if req.echo_text:  # vLLM's chat echo: the continued message first
            yield sse({**head, "choices": [{"index": i, "delta": {"content": req.echo_text}, "logprobs": None,
                                            "finish_reason": None} for i in range(n)], **opening})
        async with contextlib.aclosing(merged([stream])) as outputs:
            async for _, out in outputs:
                check_failed(out)
                choices = []
                for c in out.outputs:
                    k = c.index
                    if done[k]:
                        continue
                    delta = c.text[text_len[k]:]
                    text_len[k] = len(c.text)
                    lps = None
                    if req.logprobs and c.logprobs is not None and len(c.logprobs) > num_lps[k]:
                        lps = _logprobs(ctx, c, num_lps[k])
                        num_lps[k] = len(c.logprobs)
                    done[k] = c.finish_reason is not None
                    fields = streamers[k].feed(delta, done[k])
                    if fields or lps is not None or done[k]:
                        finish_reason = plan.finish_reason(c.finish_reason, streamers[k].num_calls)
                        choices.append({"index": k, "delta": fields, "logprobs": lps,
                                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
                if choices:
                    extra: dict[str, Any] = {}
                    if continuous:
                        extra = {"usage": running_usage(len(out.prompt_token_ids),
                                                        sum(len(c.token_ids) for c in out.outputs))}
                    yield sse({**head, "choices": choices, **extra})
                if out.finished:
                    final = out
        if req.include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": _usage(final)})
    except KVServeError as e:
        yield sse({"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": e.status_code}})
    finally:
        stream.abort()
    yield SSE_DONE
