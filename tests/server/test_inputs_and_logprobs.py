"""Hostile bodies, the KV pool vs ``max_model_len``, and logprobs (prompt, echo, byte-level tokens, streaming)
against a live server with the official ``openai`` client where it applies.

The server gets a pool of 32 blocks x 16 tokens and no ``--max-model-len``: ``max_model_len`` is lowered to
the pool's 512 tokens (as vLLM), so every request the length check admits runs to its ``max_tokens``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_harness import MODEL, Server, sse_events

pytestmark = pytest.mark.slow

POOL_TOKENS = 32 * 16
C, CHAT = "/v1/completions", "/v1/chat/completions"
EMOJI_CHAT = [{"role": "user", "content": "Reply with three emoji only: 😀🎉🌊"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--num-gpu-blocks-override", "32", "--block-size", "16", "--max-num-seqs", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)


def _raw(server: Server, path: str, content: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def _error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param, err
    return dict(err)


def _stream(server: Server, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", server.url + path, json={"model": MODEL, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


# ---- hostile bodies -------------------------------------------------------------------------------
def test_lone_surrogate_is_400_naming_the_field(server: Server) -> None:
    m = f'"model": "{MODEL}", '.encode()
    cases = [
        (C, b'{' + m + b'"prompt": "a \\ud800 b", "max_tokens": 2}', "prompt"),
        (C, b'{' + m + b'"prompt": ["ok", "x\\udfff"], "max_tokens": 2}', "prompt[1]"),
        ("/tokenize", b'{"prompt": "a \\ud800 b"}', "prompt"),
        (CHAT, b'{' + m + b'"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 2}',
         "messages[0].content"),
        ("/tokenize", b'{"messages": [{"role": "user", "content": "\\uDBFF"}]}', "messages[0].content"),
    ]
    for path, body, param in cases:
        err = _error(_raw(server, path, body), 400, param)
        assert "surrogate" in err["message"] and "TextEncodeInput" not in err["message"]
    # A proper surrogate pair is a character (U+1F600), not an error.
    ok = _raw(server, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
    assert ok.status_code == 200 and ok.json()["count"] >= 1
    assert server.alive()


@pytest.mark.parametrize("path", [C, CHAT, "/tokenize", "/detokenize"])
def test_deeply_nested_json_is_400(server: Server, path: str) -> None:
    for depth in (1500, 200):  # past Python's recursion limit, and past kvserve's 128 levels
        body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        err = _error(_raw(server, path, body), 400, "prompt" if depth == 200 else None)
        assert "nested deeper than 128" in err["message"]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


# ---- the KV pool and max_model_len ----------------------------------------------------------------
def test_max_model_len_is_lowered_to_the_pool(server: Server, client: openai.OpenAI) -> None:
    card = client.models.list().data[0]
    assert card.model_extra["max_model_len"] == POOL_TOKENS  # type: ignore[index]
    assert "max_model_len lowered from the model's 8192 to 512" in server.log.read_text()
    # prompt + max_tokens over the pool: the vLLM 400, never a silent early "length".
    err = _error(_post(server, C, {"prompt": [7] * 500, "max_tokens": 20, "ignore_eos": True}), 400, "max_tokens")
    assert "512" in err["message"] and "520" in err["message"]
    # A prompt exactly the pool's size: the requirement stated is room for one output token.
    err = _error(_post(server, C, {"prompt": [7] * POOL_TOKENS, "max_tokens": 1}), 400, "prompt")
    assert err["message"] == ("prompt: this model's maximum context length is 512 tokens, but the prompt has "
                              "512 tokens (no room for any output)")
    # What fits runs to the end: max_tokens asked = tokens given; max_tokens null = the rest of the pool.
    r = client.completions.create(model=MODEL, prompt=[7] * 490, max_tokens=22, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 22 and r.choices[0].finish_reason == "length"
    r = _post(server, C, {"prompt": [7] * 500, "max_tokens": None, "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 12


def test_pool_smaller_than_given_max_model_len_refuses_to_start() -> None:
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", MODEL, "--max-model-len", "1024",
           "--num-gpu-blocks-override", "32", "--block-size", "16", "--num-threads", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode != 0
    assert "max_model_len: 1024 is larger than the 512 tokens the KV cache can hold" in p.stderr, p.stderr[-2000:]


# ---- logprobs -------------------------------------------------------------------------------------
def test_streamed_text_offset_equals_non_streamed_with_stop(server: Server) -> None:
    base = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "logprobs": 1}
    plain = _post(server, C, base).json()["choices"][0]
    tokens = plain["logprobs"]["tokens"]
    matching = "".join(tokens[6:8])  # a stop string over two tokens, mid-output
    for stop in (["never-matches-zzz"], [matching], ["never", matching]):
        whole = _post(server, C, {**base, "stop": stop}).json()["choices"][0]
        events = _stream(server, C, {**base, "stop": stop})
        chunks = [ch for e in events[:-1] for ch in e["choices"]]
        merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for ch in chunks:
            for key in merged:
                merged[key] += (ch["logprobs"] or {}).get(key, [])
        assert "".join(ch["text"] for ch in chunks) == whole["text"]
        assert merged == whole["logprobs"], stop
        assert all(0 <= o <= len(whole["text"]) for o in merged["text_offset"])


def test_byte_level_tokens_in_logprobs(server: Server, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=EMOJI_CHAT, max_tokens=30, temperature=0,  # type: ignore[arg-type]
                                       logprobs=True, top_logprobs=2)
    text = r.choices[0].message.content or ""
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert "🌊" in text and any(c.token.startswith("bytes:\\x") for c in content)
    assert b"".join(bytes(c.bytes or []) for c in content) == text.encode()
    for c in content:
        if c.token.startswith("bytes:"):
            assert c.token == "bytes:" + "".join(f"\\x{b:02x}" for b in c.bytes or [])
    # Completions: offsets stay inside the text and point at the character a piece belongs to.
    tok = _post(server, "/tokenize", {"messages": EMOJI_CHAT})
    prompt_ids = tok.json()["tokens"]
    choice = _post(server, C, {"prompt": prompt_ids, "max_tokens": 30, "temperature": 0, "logprobs": 0,
                               "echo": True}).json()["choices"][0]
    text, lps = choice["text"], choice["logprobs"]
    offsets = lps["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    assert len(lps["tokens"]) == len(prompt_ids) + 30
    n = len(prompt_ids)
    for i in range(n, n + 27, 3):  # each emoji = 3 tokens: all three start at the emoji's index
        assert offsets[i] == offsets[i + 1] == offsets[i + 2] == offsets[i + 3] - 1
        assert text[offsets[i]] in "🌈🌊"


def test_echo_with_logprobs_and_prompt_logprobs(server: Server, client: openai.OpenAI) -> None:
    prompt = "The sky is blue and the grass is"
    ids = _post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  extra_body={"prompt_logprobs": 2})
    choice = r.choices[0]
    lps = choice.logprobs
    assert lps is not None and choice.text.startswith(prompt)
    assert len(lps.tokens or []) == len(ids) + 3
    assert (lps.token_logprobs or [])[0] is None and (lps.top_logprobs or [])[0] is None
    assert all(v is not None and v <= 0 for v in (lps.token_logprobs or [])[1:])
    assert "".join((lps.tokens or [])[:len(ids)]) == prompt and (lps.text_offset or [])[:2] == [0, len("The")]
    plp = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx((lps.token_logprobs or [])[i], abs=1e-6)
        assert entry["decoded_token"] == (lps.tokens or [])[i] and entry["rank"] >= 1
        assert 2 <= len(plp[i]) <= 3 and len((lps.top_logprobs or [])[i]) in (2, 3)
    # Streamed echo + logprobs: the same entries (the prompt's first), in chunks.
    events = _stream(server, C, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2})
    streamed = [t for e in events[:-1] for ch in e["choices"] for t in (ch["logprobs"] or {}).get("tokens", [])]
    assert streamed == lps.tokens
    # max_tokens=0 scores the prompt only (lm-eval's loglikelihood request).
    scored = _post(server, C, {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    assert scored["choices"][0]["text"] == prompt and scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lps.token_logprobs[:len(ids)])  # type: ignore[index]
    # Chat: vLLM's top-level prompt_logprobs.
    chat = _post(server, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(row) == 1 for row in chat["prompt_logprobs"][1:])
    # Limits: more than --max-logprobs (20), and prompt_logprobs with stream (as vLLM) are 400s.
    _error(_post(server, C, {"prompt": prompt, "prompt_logprobs": 21}), 400, "prompt_logprobs")
    _error(_post(server, C, {"prompt": prompt, "logprobs": 21}), 400, "logprobs")
    _error(_post(server, C, {"prompt": prompt, "prompt_logprobs": 1, "stream": True}), 400, "prompt_logprobs")
