"""The OpenAI-compatible server: FastAPI routes over an :class:`AsyncLLM`, run by uvicorn.

    kvserve serve smollm2-135m-instruct --port 8000 [--api-key KEY] [--chat-template FILE] [engine flags]

| route | what |
|---|---|
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | OpenAI's APIs, streamed (SSE) or not |
| ``GET /v1/models`` | the served model |
| ``GET /health`` | 200, or 503 once the engine loop died |
| ``GET /version``, ``GET /metrics`` | version; Prometheus metrics (``kvserve:*``, ``--metrics-prefix``) |
| ``POST /tokenize``, ``POST /detokenize`` | the server's tokenizer (vLLM's shapes) |

Every error is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``. ``--api-key`` guards
``/v1/*`` only (as vLLM). Bodies are parsed by hand (size limit, UTF-8, JSON) and validated by the pydantic
models of ``protocol.py``, so a malformed request is a 4xx naming the field, never a 500.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import kvserve
from kvserve.config import EngineConfig
from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_error,
)
from kvserve.entrypoints.openai.serving import ServerContext
from kvserve.entrypoints.openai.serving_chat import create_chat_completion
from kvserve.entrypoints.openai.serving_completion import create_completion
from kvserve.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS
from kvserve.errors import InvalidRequestError, KVServeError
from kvserve.metrics import EngineMetrics
from kvserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

_PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _error_response(e: KVServeError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.error_type, e.param, e.status_code), status_code=e.status_code)


async def _parse(ctx: ServerContext, raw: Request, model: type[M]) -> M:
    obj = await ctx.read_json(raw)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


def build_app(ctx: ServerContext, cors: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops ``ctx.llm``.

    Args:
        cors: keyword arguments of Starlette's ``CORSMiddleware`` (``allow_origins``, ...); None: no CORS headers.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.llm.start()
        try:
            yield
        finally:
            ctx.llm.shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)

    @app.exception_handler(KVServeError)
    async def _kvserve_error(raw: Request, e: Exception) -> Response:
        assert isinstance(e, KVServeError)
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw: Request, e: Exception) -> Response:
        assert isinstance(e, StarletteHTTPException)
        err_type = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{raw.method} {raw.url.path}: {e.detail}", err_type, None, e.status_code),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(raw: Request, e: Exception) -> Response:
        logger.exception("internal error on %s %s", raw.method, raw.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "internal_error", None, 500),
                            status_code=500)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        ctx.check_auth(raw)
        return await create_completion(ctx, raw, await _parse(ctx, raw, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        ctx.check_auth(raw)
        return await create_chat_completion(ctx, raw, await _parse(ctx, raw, ChatCompletionRequest))

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        ctx.check_auth(raw)
        card = {"id": ctx.served_model_name, "object": "model", "created": int(started), "owned_by": "kvserve",
                "root": ctx.llm.engine.config.model, "max_model_len": ctx.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        dead = ctx.llm.dead_error
        return Response(status_code=200) if dead is None else _error_response(dead)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": kvserve.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.llm.metrics.render(), media_type=_PROMETHEUS_CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        req = await _parse(ctx, raw, TokenizeRequest)
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise InvalidRequestError("prompt: no tokenizer (--skip-tokenizer-init is set)", param="prompt")
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("prompt: give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
            ids = ctx.apply_chat_template(msgs, req.add_generation_prompt)
        else:
            ids = ctx.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len})

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = await _parse(ctx, raw, DetokenizeRequest)
        ctx.check_model(req.model)
        if ctx.tokenizer is None:
            raise InvalidRequestError("tokens: no tokenizer (--skip-tokenizer-init is set)", param="tokens")
        vocab = ctx.llm.engine.arch.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens: token id {bad} is out of range [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": ctx.tokenizer.decode(req.tokens)})

    started = time.time()
    return app


# ---- the command ---------------------------------------------------------------------------------
def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's come from ``EngineConfig.add_cli_args``)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="answer 429 when more sequences than this would wait for a batch slot (0: no limit)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--uvicorn-loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                   help="the event loop (auto: uvloop where installed, as uvicorn; asyncio is the fallback)")
    g.add_argument("--uvicorn-http", default="auto", choices=["auto", "httptools", "h11"],
                   help="the HTTP/1.1 parser (auto: httptools where installed, as uvicorn; h11 is the fallback)")
    g.add_argument("--max-request-body-mib", type=float, default=8.0, help="largest request body accepted (MiB)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template replacing the model's: a file path or the template itself")
    g.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins, JSON (default ["*"])')
    g.add_argument("--allowed-methods", type=_json_list, default=["*"], help='CORS methods, JSON (default ["*"])')
    g.add_argument("--allowed-headers", type=_json_list, default=["*"], help='CORS headers, JSON (default ["*"])')
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request's prompt and params")
    g.add_argument("--max-log-len", type=int, default=None, help="characters of a prompt shown in the request log")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides to call tools (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="how tool calls are read from the output (hermes: <tool_call>{json}</tool_call>, Qwen2.5)")
    g.add_argument("--engine-loop", default="thread", choices=["thread", "inline"],
                   help="where the engine loop runs: its own thread (default), or inline as a task on the HTTP "
                        "event loop's thread (no thread hand-off per token; a step blocks the event loop)")
    g.add_argument("--metrics-prefix", default="kvserve", choices=["kvserve", "vllm"],
                   help="metric names kvserve:* or vllm:* (vLLM's Grafana dashboards read vllm:*)")


def _json_list(text: str) -> list[str]:
    """A CORS flag value: a JSON list of strings (as vLLM), or one bare value (``*``, ``http://a.com``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return [text]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def load_chat_template(value: str) -> str:
    """``--chat-template``: the file's text when ``value`` is a readable file, else ``value`` itself as a template
    (with ``\\n`` escapes decoded, as vLLM). The template must parse as Jinja.

    Raises:
        InvalidRequestError: a value that looks like a path (no ``{``, ``}`` or newline) but cannot be read, or
            a template that does not parse (``param`` is ``chat_template``).
    """
    import jinja2

    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise InvalidRequestError(f"chat_template: {value!r} looks like a file path but cannot be read: {e}",
                                      param="chat_template") from None
        # backslashreplace first, so that non-Latin-1 characters survive the escape decoding
        template = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidRequestError(f"chat_template: not a valid Jinja template: {e}", param="chat_template") from None
    return template


def build_context(args: argparse.Namespace) -> ServerContext:
    """Load the engine (seconds) and wrap it for the server; prints the startup summary.

    Raises:
        ModelNotFoundError, InvalidRequestError: a bad model or engine flag.
    """
    from kvserve.engine.async_llm import build_engine_off_main_thread

    config = EngineConfig.from_cli_args(args)
    engine = build_engine_off_main_thread(config)  # (keeps the main thread free of OpenMP teams)
    name = config.served_model_name or config.model
    tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_path(engine.model_path)
    if tokenizer is not None and args.chat_template is not None:
        tokenizer.hf.chat_template = load_chat_template(args.chat_template)
    limit = args.max_waiting_requests if args.max_waiting_requests > 0 else None
    metrics = EngineMetrics(name, prefix=args.metrics_prefix, max_model_len=engine.max_model_len)
    inline = args.engine_loop == "inline"
    llm = AsyncLLM(engine, metrics=metrics, max_waiting_requests=limit, inline=inline)
    print(f"[kvserve] serving {name!r} ({config.model}) on {engine.device}, dtype {engine.dtype}, "
          f"max_model_len {engine.max_model_len}, {engine.num_blocks} KV blocks of {config.block_size} tokens "
          f"({engine.kv_cache_capacity_tokens} tokens): max concurrency {engine.max_concurrency():.2f} requests "
          f"of {engine.max_model_len} tokens", file=sys.stderr, flush=True)
    return ServerContext(llm=llm, tokenizer=tokenizer, served_model_name=name,
                         model_aliases=frozenset({name, config.model}), max_model_len=engine.max_model_len,
                         api_key=args.api_key, max_body_bytes=int(args.max_request_body_mib * 2**20),
                         sampling_defaults=dict(engine.default_sampling_params),
                         log_requests=not args.disable_log_requests, max_log_len=args.max_log_len,
                         tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)


def check_server_args(args: argparse.Namespace) -> None:
    """The server flags' checks that need no model (so that a bad one fails before any model loads).

    Raises:
        InvalidRequestError: naming the flag.
    """
    if args.max_waiting_requests < 0:
        raise InvalidRequestError("max_waiting_requests: must be >= 0", param="max_waiting_requests")
    if args.chat_template is not None:
        load_chat_template(args.chat_template)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise InvalidRequestError("enable_auto_tool_choice: --enable-auto-tool-choice requires --tool-call-parser",
                                  param="tool_call_parser")
    http_stack(args)


def http_stack(args: argparse.Namespace) -> tuple[str, str]:
    """``(loop, http)`` for uvicorn from ``--uvicorn-loop`` / ``--uvicorn-http``: ``auto`` resolves as uvicorn's
    own ``auto`` does (uvloop / httptools when importable, else asyncio / h11), here so that it can be logged.

    Why the fast pair is the default: per streamed token the event loop's thread spends (SmolLM2, 2 vCPUs Zen 4,
    one stream; docs/performance-log.md, s44) ~0.30 ms on asyncio + h11 and ~0.20 ms on uvloop + httptools, and on
    a 2-CPU host that time is taken from the engine's step (lockstep).

    Raises:
        InvalidRequestError: ``uvloop`` or ``httptools`` named but not installed (``param`` is the flag).
    """
    from importlib.util import find_spec

    def pick(flag: str, value: str, fast: str, fallback: str) -> str:
        if value == "auto":
            return fast if find_spec(fast) is not None else fallback
        if value == fast and find_spec(fast) is None:
            raise InvalidRequestError(f"{flag}: {fast} is not installed (pip install {fast}, or use {fallback})",
                                      param=flag)
        return value

    return (pick("uvicorn_loop", args.uvicorn_loop, "uvloop", "asyncio"),
            pick("uvicorn_http", args.uvicorn_http, "httptools", "h11"))


def run_server(args: argparse.Namespace) -> int:
    """``kvserve serve``: load the model, then serve until interrupted. Returns the exit code: 0, or 1 when a
    tensor-parallel rank died (its requests were answered with errors, then the server stopped; a supervisor
    restarts it)."""
    import uvicorn

    check_server_args(args)
    ctx = build_context(args)
    app = build_app(ctx, cors={"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
                               "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials})
    loop, http = http_stack(args)
    print(f"[kvserve] HTTP: uvicorn on {loop} + {http}", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=10, loop=loop,
                            http=http)
    server = uvicorn.Server(config)
    executor_died: list[bool] = []

    def stop() -> None:
        print(f"[kvserve] {ctx.llm.dead_error}; stopping the server", file=sys.stderr, flush=True)
        executor_died.append(True)
        server.should_exit = True

    ctx.llm.on_executor_dead = stop
    server.run()
    return 1 if executor_died else 0
