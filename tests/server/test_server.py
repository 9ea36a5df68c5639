"""The OpenAI server against a live ``kvserve serve`` on a free loopback port, with the official client.

One server per fixture (module scope), small ``max_tokens`` everywhere: the whole module must stay within a
few minutes on 2 shared cores.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_harness import MODEL, Server, is_idle, sse_events

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def fallback_server() -> Iterator[Server]:
    """The same server on the fallback HTTP stack (asyncio + h11), as where uvloop / httptools are missing."""
    s = Server("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--uvicorn-loop", "asyncio",
               "--uvicorn-http", "h11")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, kv_cache_memory=0.05, max_model_len=MAX_MODEL_LEN, num_threads=1)


def _post(server: Server, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def _stream_text(events: list[Any], n: int) -> list[str]:
    texts = [""] * n
    for e in events[:-1]:
        for ch in e["choices"]:
            texts[ch["index"]] += ch["text"] if "text" in ch else ch["delta"].get("content", "")
    return texts


# ---- completions and chat --------------------------------------------------------------------------
def test_greedy_text_equals_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    sp = SamplingParams(temperature=0, max_tokens=16)
    want = [o.outputs[0].text for o in offline.generate(prompts, sp, use_tqdm=False)]
    r = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=16)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    streamed = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=16, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    chat_want = offline.chat(msgs, sp, use_tqdm=False)[0].outputs[0].text
    chat = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=16)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == chat_want and chat.choices[0].message.role == "assistant"


def test_n2_seeded_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, n=2, seed=11, temperature=0.9, max_tokens=12, ignore_eos=True)
    r = client.completions.create(prompt="Once upon a time", **{k: v for k, v in kw.items() if k != "ignore_eos"},
                                  extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and texts[0] != texts[1] and r.usage and r.usage.completion_tokens == 24
    again = client.completions.create(prompt="Once upon a time", model=MODEL, n=2, seed=11, temperature=0.9,
                                      max_tokens=12, extra_body={"ignore_eos": True}, stream=True)
    streamed = ["", ""]
    for chunk in again:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    msgs = [{"role": "user", "content": "Tell me a joke."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, n=2, seed=5, temperature=0.9,  # type: ignore[arg-type]
                                          max_tokens=10)
    chat_texts = [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]
    chat_streamed = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, n=2, seed=5,  # type: ignore[arg-type]
                                                temperature=0.9, max_tokens=10, stream=True):
        for ch in chunk.choices:
            chat_streamed[ch.index] += ch.delta.content or ""
    assert chat_streamed == chat_texts


def test_seed_reproducible_and_distinct(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt="My favourite colour is", seed=seed, temperature=1.0,
                                      max_tokens=10, extra_body={"ignore_eos": True})
        return r.choices[0].text

    assert run(3) == run(3)
    assert len({run(3), run(4), run(5)}) > 1


def test_stop_string(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=16)
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop.strip()) > 0
    r = client.completions.create(model=MODEL, prompt="Count: one, two, three,", temperature=0, max_tokens=16,
                                  stop=[stop])
    c = r.choices[0]
    assert c.text == text[: text.index(stop)] and c.finish_reason == "stop"
    assert c.model_extra and c.model_extra.get("stop_reason") == stop


def test_logprobs_completions_and_chat(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == 6  # type: ignore[union-attr]
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) >= 3 and top[token] == pytest.approx(value)
        assert max(top.values()) == pytest.approx(value)  # greedy: the chosen token is the most likely
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          temperature=0, max_tokens=5, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                temperature=0, max_tokens=5, logprobs=True, top_logprobs=2,
                                                stream=True):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                streamed += [t.token for t in ch.logprobs.content]
    assert streamed == [t.token for t in content]


def test_token_id_prompts_and_indices(client: openai.OpenAI, server: Server) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=[ids, ids], n=2, temperature=0, max_tokens=4)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1  # greedy: all four identical
    single = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4)
    assert single.choices[0].text == r.choices[0].text
    assert r.usage and r.usage.prompt_tokens == 2 * len(ids) and r.usage.completion_tokens == 16


def test_echo(server: Server) -> None:
    r = _post(server, "/v1/completions", {"prompt": "The sky is", "max_tokens": 0, "echo": True})
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == "The sky is" and body["usage"]["completion_tokens"] == 0
    r = _post(server, "/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "echo": True, "temperature": 0})
    assert r.json()["choices"][0]["text"].startswith("The sky is")
    r = _post(server, "/v1/completions", {"prompt": "The sky is", "max_tokens": 1, "echo": True, "logprobs": 1})
    lps = r.json()["choices"][0]["logprobs"]
    assert lps["tokens"][:3] == ["The", " sky", " is"] and lps["token_logprobs"][0] is None and len(lps["tokens"]) == 4


def test_info_endpoints(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN  # type: ignore[index]
    assert httpx.get(server.url + "/version").json()["version"]
    tok = _post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    assert _post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat_tok = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["count"] > 2


def test_unknown_model_is_404(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert e.value.body["param"] == "model"  # type: ignore[index]
    r = httpx.get(server.url + "/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# ---- malformed requests --------------------------------------------------------------------------
C, CHAT = "/v1/completions", "/v1/chat/completions"
_BASE = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
_CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
_DROP = object()

# (path, body changes or raw bytes, status, param): param None means "the body as a whole".
MALFORMED: list[tuple[str, Any, int, str | None]] = [
    (C, {"max_tokens": "ten"}, 400, "max_tokens"),
    (C, {"max_tokens": -1}, 400, "max_tokens"),
    (C, {"max_tokens": 1.5}, 400, "max_tokens"),
    (C, {"max_tokens": True}, 400, "max_tokens"),
    (C, {"max_tokens": 10_000}, 400, "max_tokens"),
    (C, {"temperature": -1}, 400, "temperature"),
    (C, {"temperature": "hot"}, 400, "temperature"),
    (C, {"top_p": 0}, 400, "top_p"),
    (C, {"top_p": 1.5}, 400, "top_p"),
    (C, {"top_k": -2}, 400, "top_k"),
    (C, {"top_k": 10**30}, 400, "top_k"),
    (C, {"min_p": 2}, 400, "min_p"),
    (C, {"n": 0}, 400, "n"),
    (C, {"n": 1_000_000}, 400, "n"),
    (C, {"n": "2"}, 400, "n"),
    (C, {"presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {"repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"seed": "abc"}, 400, "seed"),
    (C, {"seed": 10**40}, 400, "seed"),
    (C, {"stop": 5}, 400, "stop"),
    (C, {"stop": [""]}, 400, "stop"),
    (C, {"stop": [1, 2]}, 400, "stop"),
    (C, {"stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (C, {"stop_token_ids": "x"}, 400, "stop_token_ids"),
    (C, {"logprobs": 21}, 400, "logprobs"),
    (C, {"logprobs": -1}, 400, "logprobs"),
    (C, {"echo": "yes"}, 400, "echo"),
    (C, {"prompt_logprobs": -2}, 400, "prompt_logprobs"),
    (C, {"stream": "yes"}, 400, "stream"),
    (C, {"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    (C, {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"min_tokens": -1}, 400, "min_tokens"),
    (C, {"min_tokens": 5}, 400, "min_tokens"),
    (C, {"ignore_eos": "no"}, 400, "ignore_eos"),
    (C, {"priority": "high"}, 400, "priority"),
    (C, {"user": 5}, 400, "user"),
    (C, {"cache_salt": ""}, 400, "cache_salt"),
    (C, {"model": 5}, 400, "model"),
    (C, {"best_of": 3}, 400, "best_of"),
    (C, {"suffix": "x"}, 400, "suffix"),
    (C, {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    (C, {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    (C, {"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [""]}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, {"prompt": [-5]}, 400, "prompt"),
    (C, {"prompt": [10**12]}, 400, "prompt"),
    (C, {"prompt": 12}, 400, "prompt"),
    (C, {"prompt": None}, 400, "prompt"),
    (C, {"prompt": _DROP}, 400, "prompt"),
    (C, {"prompt": [7] * 600}, 400, "prompt"),
    (C, {"prompt": ["Hi"] * 200}, 400, "prompt"),
    (C, b"{", 400, None),
    (C, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b'{"prompt": "Hi", "temperature": NaN}', 400, None),
    (C, b"", 400, None),
    (C, b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}', 413, None),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": _DROP}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"logprobs": "yes"}, 400, "logprobs"),
    (CHAT, {"top_logprobs": 5}, 400, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    (CHAT, {"max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {"tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"n": 0}, 400, "n"),
    ("/tokenize", {"prompt": _DROP}, 400, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
]


def _body(path: str, change: Any) -> Any:
    if isinstance(change, bytes):
        return change
    base = {} if path in ("/tokenize", "/detokenize") else dict(_CHAT_BASE if path == CHAT else _BASE)
    base.update(change)
    return {k: v for k, v in base.items() if v is not _DROP}


def test_malformed_requests_are_4xx_naming_the_field(server: Server) -> None:
    assert len(MALFORMED) >= 40
    failures = []
    with httpx.Client(timeout=60) as h:
        for path, change, status, param in MALFORMED:
            body = _body(path, change)
            if isinstance(body, bytes):
                r = h.post(server.url + path, content=body, headers={"content-type": "application/json"})
            else:
                r = h.post(server.url + path, json=body)
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
            got = err.get("param")
            ok = r.status_code == status and set(err) == {"message", "type", "param", "code"}
            if param is None:
                ok = ok and err.get("message", "").startswith("body")
            else:
                ok = ok and (got == param or str(got).startswith(param + "[")) and param.split("[")[0] in err["message"]
            if not ok:
                failures.append((path, str(change)[:60], r.status_code, r.text[:200]))
    assert not failures, failures
    assert server.alive()
    assert is_idle(server.wait_idle())
    assert server.metrics()["kvserve:kv_cache_usage_perc"] == 0


def test_method_not_allowed_is_openai_shaped(server: Server) -> None:
    r = httpx.get(server.url + C)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


# ---- disconnects ---------------------------------------------------------------------------------
_LONG = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": None, "ignore_eos": True}


def _idle_within(server: Server, seconds: float) -> float:
    t0 = time.monotonic()
    m = server.wait_for(is_idle, seconds)
    assert is_idle(m), m
    return time.monotonic() - t0


@pytest.mark.parametrize("stack", ["server", "fallback_server"])
def test_client_disconnect_aborts_within_a_second(stack: str, request: pytest.FixtureRequest) -> None:
    server: Server = request.getfixturevalue(stack)
    before = server.metrics()["kvserve:request_success_total{abort}"]
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + C, json={**_LONG, "stream": True}) as r:
        lines = r.iter_lines()  # NOTE: keep a reference: closing the iterator closes the connection
        while not next(lines).startswith("data: "):
            pass
        time.sleep(0.3)
        assert server.metrics()["kvserve:num_requests_running"] == 1
    assert _idle_within(server, 1.0) < 1.0
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up after 2 s
        httpx.post(server.url + C, json=_LONG, timeout=2.0)
    assert _idle_within(server, 1.0) < 1.0
    gen = server.metrics()["kvserve:generation_tokens_total"]
    time.sleep(0.5)
    m = server.metrics()
    assert m["kvserve:generation_tokens_total"] == gen  # nothing generates for dead clients
    assert m["kvserve:request_success_total{abort}"] == before + 2


def test_200_streams_half_disconnect_early(server: Server) -> None:
    rng = random.Random(0)
    plan = [rng.random() < 0.5 for _ in range(200)]
    before = server.metrics()
    done_texts: list[str] = []

    async def one(h: httpx.AsyncClient, sem: asyncio.Semaphore, i: int, leave: bool) -> None:
        body = {"model": MODEL, "prompt": f"Request {i}: tell me about the number {i}.", "max_tokens": 6,
                "ignore_eos": True, "stream": True, "temperature": 0.8, "seed": i}
        async with sem, h.stream("POST", server.url + C, json=body) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                if leave and line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream
                lines.append(line)
            events = sse_events(lines)
            assert events[-1] == "[DONE]" and events[-2]["choices"][-1]["finish_reason"] == "length"
            done_texts.append(_stream_text(events, 1)[0])

    async def main() -> None:
        sem = asyncio.Semaphore(16)
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as h:
            await asyncio.gather(*(one(h, sem, i, leave) for i, leave in enumerate(plan)))

    asyncio.run(main())
    m = server.wait_idle(5.0)
    assert is_idle(m), m
    assert len(done_texts) == plan.count(False) and all(done_texts)
    finished = sum(m[f"kvserve:request_success_total{{{r}}}"] - before[f"kvserve:request_success_total{{{r}}}"]
                   for r in ("stop", "length", "abort", "error"))
    assert finished == 200
    aborted = m["kvserve:request_success_total{abort}"] - before["kvserve:request_success_total{abort}"]
    assert 0 < aborted <= plan.count(True)
    assert server.alive()


# ---- auth and overload ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded() -> Iterator[Server]:
    s = Server("--max-model-len", "256", "--api-key", "secret", "--max-num-seqs", "1", "--max-waiting-requests", "1")
    yield s
    s.stop()


def test_wrong_api_key_is_401(guarded: Server) -> None:
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert httpx.post(guarded.url + C, json=_BASE).status_code == 401  # no key at all
    assert httpx.get(guarded.url + "/health").status_code == 200  # only /v1/* is guarded
    good = openai.OpenAI(base_url=guarded.url + "/v1", api_key="secret", max_retries=0)
    assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2  # type: ignore[union-attr]


def test_over_max_waiting_requests_is_429(guarded: Server) -> None:
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 20, "ignore_eos": True}
    statuses: list[int] = []

    def send() -> None:
        r = httpx.post(guarded.url + C, json=body, headers={"Authorization": "Bearer secret"}, timeout=120)
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"

    threads = [threading.Thread(target=send) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    assert is_idle(guarded.wait_idle())


# ---- the HTTP stack ------------------------------------------------------------------------------------
def test_both_http_stacks_stream_the_same_events(server: Server, fallback_server: Server) -> None:
    """uvloop + httptools (the default where installed) and asyncio + h11 (forced): the startup line names the
    stack, and a streamed greedy completion and chat with logprobs are the same events on both."""
    assert "[kvserve] HTTP: uvicorn on uvloop + httptools" in server.log.read_text(errors="replace")
    assert "[kvserve] HTTP: uvicorn on asyncio + h11" in fallback_server.log.read_text(errors="replace")
    bodies = [(C, {"prompt": "The capital of France is", "logprobs": 2}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour é ✓."}],
                                        "logprobs": True, "top_logprobs": 2})]
    for path, extra in bodies:
        body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        seen = []
        for s in (server, fallback_server):
            # a fresh salt: no prefix-cache hit from earlier tests (cached_tokens, logprobs' last bits)
            salted = {**body, "cache_salt": uuid.uuid4().hex}
            with httpx.stream("POST", s.url + path, json=salted, timeout=60) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                events = sse_events(r.iter_lines())
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 12
            seen.append([{k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
                         for e in events])
        assert seen[0] == seen[1], path
