"""``kvserve serve`` flags: the model given positionally (vLLM's ``vllm serve MODEL``) and a conflicting
``--model``; ``--disable-log-requests`` and ``--max-log-len`` against live servers; ``--allowed-origins``,
``--allowed-methods`` and ``--allowed-headers`` (CORS preflights) on the app ``run_server`` builds, in-process.
"""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from server_harness import MODEL, Server
from starlette.testclient import TestClient

import kvserve.entrypoints.cli as cli
import kvserve.entrypoints.openai.server as server_module
from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError
from kvserve.models.catalog import resolve_model_path


def _serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


# ---- the model given positionally -------------------------------------------------------------------
@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """``run_server`` replaced by a recorder: what ``cmd_serve`` hands it."""
    seen: list[argparse.Namespace] = []

    def run_server(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(server_module, "run_server", run_server)
    return seen


@pytest.mark.parametrize("argv", [
    ["some-model"],
    ["some-model", "--port", "9"],
    ["--port", "9", "some-model"],
    ["some-model", "--model", "some-model"],  # the same model twice is not a conflict
])
def test_positional_model_selects_the_model(argv: list[str], served: list[argparse.Namespace]) -> None:
    args = _serve_args(*argv)
    assert args.model_tag == "some-model"
    assert args.func(args) == 0
    assert len(served) == 1 and served[0].model == "some-model"
    assert EngineConfig.from_cli_args(served[0]).model == "some-model"


def test_model_flag_alone_and_the_default(served: list[argparse.Namespace]) -> None:
    for argv, want in ((["--model", "other-model"], "other-model"), ([], EngineConfig().model)):
        args = _serve_args(*argv)
        assert args.model_tag is None
        assert args.func(args) == 0
        assert served[-1].model == want
        assert EngineConfig.from_cli_args(served[-1]).model == want


@pytest.mark.parametrize("flag_model", ["other-model", EngineConfig().model])
def test_conflicting_model_flag_is_refused(flag_model: str, served: list[argparse.Namespace],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # also when --model spells the default model: it was given, and it is not the positional one
    args = _serve_args("some-model", "--model", flag_model)
    with pytest.raises(InvalidRequestError) as e:
        args.func(args)
    assert e.value.param == "model"
    assert "'some-model'" in e.value.message and repr(flag_model) in e.value.message
    assert served == []
    # the command line: exit status 2 and one clear line on stderr, before any model loads
    assert cli.main(["serve", "some-model", "--model", flag_model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model: given twice") and "'some-model'" in err and repr(flag_model) in err
    assert served == []


# ---- live servers: the positional form, the request log ----------------------------------------------
MAX_LOG_LEN = 8
GGUF = str(resolve_model_path(MODEL))


@pytest.fixture(scope="module")
def positional_server() -> Iterator[Server]:
    """Started as ``kvserve serve /path/to/model.gguf``, without ``--model``; prompts logged cut to 8."""
    s = Server("--max-model-len", "256", "--max-log-len", str(MAX_LOG_LEN), positional_model=GGUF)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quiet_server() -> Iterator[Server]:
    s = Server("--max-model-len", "256", "--disable-log-requests")
    yield s
    s.stop()


def _log_lines(server: Server, request_prefix: str) -> list[str]:
    return [ln for ln in server.log.read_text(errors="replace").splitlines()
            if f"Received request {request_prefix}-" in ln]


@pytest.mark.slow
def test_positional_model_serves_completions(positional_server: Server) -> None:
    models = httpx.get(positional_server.url + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(GGUF, GGUF)]  # not the default model's name
    r = httpx.post(positional_server.url + "/v1/completions", timeout=120, json={
        "model": GGUF, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == GGUF and body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]


@pytest.mark.slow
def test_max_log_len_truncates_the_logged_prompt(positional_server: Server) -> None:
    prompt = "abcdefgh-TAIL-NOT-LOGGED"
    r = httpx.post(positional_server.url + "/v1/completions", timeout=120,
                   json={"model": GGUF, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    lines = [ln for ln in _log_lines(positional_server, "cmpl") if "abcdefgh" in ln]
    assert len(lines) == 1, positional_server.log_text()
    assert f"prompt: {prompt[:MAX_LOG_LEN]!r}, params: " in lines[0] and "TAIL" not in lines[0]
    # a chat prompt is logged as token ids: the first 8
    r = httpx.post(positional_server.url + "/v1/chat/completions", timeout=120, json={
        "model": GGUF, "messages": [{"role": "user", "content": "a long enough message " * 4}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > MAX_LOG_LEN
    chat = _log_lines(positional_server, "chatcmpl")
    assert len(chat) == 1, positional_server.log_text()
    m = re.search(r"prompt: (\[[0-9, ]*\]), params: ", chat[0])
    assert m, chat[0]
    ids = ast.literal_eval(m.group(1))
    assert len(ids) == MAX_LOG_LEN and all(isinstance(i, int) for i in ids)


@pytest.mark.slow
def test_disable_log_requests_logs_no_request(quiet_server: Server) -> None:
    prompt = "please do not log this prompt"
    for path, body in (("/v1/completions", {"prompt": prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]})):
        r = httpx.post(quiet_server.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=120)
        assert r.status_code == 200, r.text
    log = quiet_server.log.read_text(errors="replace")
    assert "[kvserve] serving" in log  # the log is the server's output: the startup line is there
    assert "Received request" not in log and prompt not in log, log[-3000:]


# ---- CORS: the app run_server builds from the flags ---------------------------------------------------
def _app_from_flags(monkeypatch: pytest.MonkeyPatch, *argv: str) -> Any:
    """``kvserve serve ARGV`` up to uvicorn: the real flag parsing and ``build_app``, no model and no socket."""
    apps: list[Any] = []
    monkeypatch.setattr(server_module, "build_context", lambda args: SimpleNamespace(llm=SimpleNamespace()))
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: apps.append(self.config.app))
    args = _serve_args(*argv)
    assert args.func(args) == 0
    assert len(apps) == 1
    return apps[0]


def _preflight(client: TestClient, origin: str, method: str, headers: str | None = None) -> Any:
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers is not None:
        h["Access-Control-Request-Headers"] = headers
    return client.options("/v1/completions", headers=h)


def test_cors_allowed_methods_and_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app_from_flags(monkeypatch, "--allowed-origins", '["http://a.example"]', "--allowed-methods", '["GET"]',
                          "--allowed-headers", '["x-custom"]')
    client = TestClient(app)  # (not entered: no lifespan, no engine)
    ok = _preflight(client, "http://a.example", "GET", "x-custom")
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == "http://a.example"
    assert ok.headers["access-control-allow-methods"] == "GET"
    assert "x-custom" in ok.headers["access-control-allow-headers"].lower().split(", ")
    assert "access-control-allow-credentials" not in ok.headers
    assert _preflight(client, "http://a.example", "GET").status_code == 200  # no headers asked for
    for method, headers, why in (("POST", "x-custom", "method"), ("DELETE", None, "method"),
                                 ("GET", "x-other", "headers"), ("GET", "x-custom, authorization", "headers")):
        r = _preflight(client, "http://a.example", method, headers)
        # (Starlette still names the allowed origin; the browser refuses on the status)
        assert r.status_code == 400 and f"Disallowed CORS {why}" in r.text, (method, headers, r.text)
    bad_origin = _preflight(client, "http://b.example", "GET", "x-custom")
    assert bad_origin.status_code == 400 and "Disallowed CORS origin" in bad_origin.text
    # a simple (non-preflight) request from the allowed origin carries the header; another origin's does not
    v = client.get("/version", headers={"Origin": "http://a.example"})
    assert v.status_code == 200 and v.headers["access-control-allow-origin"] == "http://a.example"
    assert "access-control-allow-origin" not in client.get("/version", headers={"Origin": "http://b.example"}).headers


def test_cors_defaults_allow_everything_and_credentials_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    client = TestClient(_app_from_flags(monkeypatch))
    r = _preflight(client, "http://anywhere.example", "DELETE", "x-whatever, authorization")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert r.headers["access-control-allow-headers"] == "x-whatever, authorization"  # "*": the asked-for ones
    creds = TestClient(_app_from_flags(monkeypatch, "--allowed-origins", "http://a.example", "--allowed-methods",
                                       "PUT", "--allow-credentials"))  # bare values, not JSON lists
    r = _preflight(creds, "http://a.example", "PUT")
    assert r.status_code == 200 and r.headers["access-control-allow-credentials"] == "true"
    assert _preflight(creds, "http://a.example", "GET").status_code == 400


@pytest.mark.parametrize("value", ['{"GET": 1}', '[1, 2]', '"GET"'])
def test_cors_flag_that_is_not_a_list_of_strings_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _serve_args("--allowed-methods", value)
    assert e.value.code == 2
    assert "--allowed-methods" in capsys.readouterr().err


# ---- the HTTP stack and the SSE encoding -------------------------------------------------------------
def test_http_stack_auto_prefers_uvloop_httptools_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    assert server_module.http_stack(_serve_args()) == ("uvloop", "httptools")  # both are dependencies
    assert server_module.http_stack(_serve_args("--uvicorn-loop", "asyncio", "--uvicorn-http", "h11")) == (
        "asyncio", "h11")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("uvloop", "httptools") else real(name, *a))
    assert server_module.http_stack(_serve_args()) == ("asyncio", "h11")
    for flag, value in (("--uvicorn-loop", "uvloop"), ("--uvicorn-http", "httptools")):
        with pytest.raises(InvalidRequestError, match=f"{value} is not installed") as e:
            server_module.http_stack(_serve_args(flag, value))
        assert e.value.param == flag[2:].replace("-", "_")


def test_sse_bytes_equal_json_dumps() -> None:
    import json

    from kvserve.entrypoints.openai.serving import SSE_DONE, sse

    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1796661890, "model": "m",
             "choices": [{"index": 0, "text": " Paris\u2028é ✓\x01\"\\\n", "logprobs": {
                 "tokens": [" Paris"], "token_logprobs": [-0.25], "top_logprobs": [{" Paris": -0.25, "x": -9999.0}],
                 "text_offset": [0]}, "finish_reason": None, "stop_reason": None}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    expected = f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
    assert sse(chunk) == expected
    assert SSE_DONE == b"data: [DONE]\n\n"
