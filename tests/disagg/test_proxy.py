"""``kvserve proxy`` against stub prefill and decode instances (proxy_stubs.py): exact texts, logprobs, usage,
finish reasons, seeds, retries, recompute fallback, errors, refusals, disconnects, routing and the command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.disagg.proxy import Proxy, serve_proxy
from kvserve.disagg.proxy_cli import ProxyConfig
from kvserve.entrypoints.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proxy_stubs import MODEL, Stub, stubs  # noqa: E402

T = TypeVar("T")
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi there"}]  # 2 prompt tokens


def run(coro: Awaitable[T], timeout: float = 30.0) -> T:
    async def go() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(go())


@asynccontextmanager
async def proxy_over(ps: list[Stub], ds: list[Stub], **kwargs: Any) -> AsyncIterator[tuple[str, Proxy]]:
    cfg = ProxyConfig.from_urls([p.url for p in ps], [d.url for d in ds], **kwargs)
    async with serve_proxy(cfg) as (url, proxy):
        yield url, proxy


async def post(url: str, body: Any, path: str = CMPL) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s, s.post(url + path, data=data,
                                                    headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(content_type=None)


def parse_sse(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def stream(url: str, body: dict[str, Any], path: str = CMPL) -> list[Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.content_type == "text/event-stream"
        return parse_sse(await r.text())


def joined(events: list[Any], chat: bool) -> dict[int, str]:
    out: dict[int, str] = {}
    for ev in events:
        for ch in ev.get("choices", []) if isinstance(ev, dict) else []:
            piece = (ch["delta"].get("content") or "") if chat else ch["text"]
            out[ch["index"]] = out.get(ch["index"], "") + piece
    return out


def choice_events(events: list[Any], index: int) -> list[dict[str, Any]]:
    return [ch for ev in events if isinstance(ev, dict) for ch in ev.get("choices", []) if ch["index"] == index]


async def metric(base: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def words(seed: int, ks: range) -> str:
    """The stub's text for tokens ``ks`` of a choice seeded ``seed``."""
    return "".join(f" s{seed}t{k}" for k in ks)


# ---- completions and chat, streamed or not ---------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2])
def test_completions_non_streamed(n: int) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            body = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "seed": 7, "n": n, "logprobs": 1}
            status, data = await post(url, body)
            assert status == 200, data
            assert data["object"] == "text_completion" and data["model"] == MODEL and data["id"].startswith("cmpl-")
            assert [c["index"] for c in data["choices"]] == list(range(n))
            for j, c in enumerate(data["choices"]):
                assert c["text"] == words(7 + j, range(4))
                assert c["finish_reason"] == "length" and c["stop_reason"] is None
                lp = c["logprobs"]
                assert lp["tokens"] == [f" s{7 + j}t{k}" for k in range(4)]
                assert lp["token_logprobs"] == [-0.25, -0.5, -0.75, -1.0]
                assert lp["text_offset"] == [0, 5, 10, 15]
                assert lp["top_logprobs"][3] == {f" s{7 + j}t3": -1.0}
            assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 4 * n, "total_tokens": 3 + 4 * n}
            # one P and one D request per choice, seeded seed + i
            assert sorted(b["seed"] for b in ps[0].bodies) == sorted(b["seed"] for b in ds[0].bodies) \
                == list(range(7, 7 + n))
            for b in ps[0].bodies:
                assert b == {**body, "n": 1, "seed": b["seed"], "max_tokens": 1, "stream": False,
                             "kv_transfer_params": {"do_remote_decode": True}}
            ids = []
            for b in ds[0].bodies:
                kv = b["kv_transfer_params"]
                assert kv["do_remote_prefill"] and kv["first_token_ids"] == [100] and kv["num_prompt_tokens"] == 3
                assert b == {**body, "n": 1, "seed": b["seed"], "stream": False, "kv_transfer_params": kv}
                ids.append(kv["remote_request_id"])
            assert sorted(ids) == [f"stub-p-{k}" for k in range(1, n + 1)]
            assert ps[0].released == []

    run(go())


@pytest.mark.parametrize("n", [1, 2])
def test_chat_non_streamed(n: int) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            body = {"messages": USER, "max_completion_tokens": 3, "seed": 5, "n": n, "logprobs": True,
                    "min_tokens": 2}
            status, data = await post(url, body, CHAT)
            assert status == 200, data
            assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
            for j, c in enumerate(data["choices"]):
                assert c["index"] == j
                assert c["message"] == {"role": "assistant", "content": words(5 + j, range(3))}
                assert [e["token"] for e in c["logprobs"]["content"]] == [f" s{5 + j}t{k}" for k in range(3)]
                assert [e["logprob"] for e in c["logprobs"]["content"]] == [-0.25, -0.5, -0.75]
                assert c["finish_reason"] == "length"
            assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 3 * n, "total_tokens": 2 + 3 * n}
            for b in ps[0].bodies:  # max_completion_tokens gone, max_tokens 1, min_tokens clamped
                assert "max_completion_tokens" not in b and b["max_tokens"] == 1 and b["min_tokens"] == 1
            for b in ds[0].bodies:
                assert b["max_completion_tokens"] == 3 and b["min_tokens"] == 2 and "max_tokens" not in b

    run(go())


@pytest.mark.parametrize(("n", "usage"), [(1, True), (2, True), (2, False)])
def test_completions_streamed(n: int, usage: bool) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            body: dict[str, Any] = {"prompt": "a b c", "max_tokens": 4, "seed": 7, "n": n, "logprobs": 0,
                                    "stream": True}
            if usage:
                body["stream_options"] = {"include_usage": True}
            events = await stream(url, body)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert len({e["id"] for e in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
            assert {e["model"] for e in chunks} == {MODEL} and {e["object"] for e in chunks} == {"text_completion"}
            assert joined(chunks, chat=False) == {j: words(7 + j, range(4)) for j in range(n)}
            for j in range(n):
                evs = choice_events(chunks, j)
                assert evs[0] == {"index": j, "text": f" s{7 + j}t0",
                                  "logprobs": {"tokens": [f" s{7 + j}t0"], "token_logprobs": [-0.25],
                                               "top_logprobs": [{f" s{7 + j}t0": -0.25}], "text_offset": [0]},
                                  "finish_reason": None}
                assert [e["finish_reason"] for e in evs] == [None, None, None, "length"]
                assert [e["logprobs"]["text_offset"] for e in evs] == [[0], [5], [10], [15]]
            if usage:
                assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
                    "prompt_tokens": 3, "completion_tokens": 4 * n, "total_tokens": 3 + 4 * n}
            else:
                assert all("usage" not in e for e in chunks)
            for b in ds[0].bodies:
                assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
            for b in ps[0].bodies:
                assert b["stream"] is False and "stream_options" not in b

    run(go())


@pytest.mark.parametrize("n", [1, 2])
def test_chat_streamed(n: int) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            body = {"messages": USER, "max_tokens": 3, "seed": 5, "n": n, "stream": True,
                    "stream_options": {"include_usage": True}}
            events = await stream(url, body, CHAT)
            chunks = events[:-1]
            assert events[-1] == "[DONE]" and {e["object"] for e in chunks} == {"chat.completion.chunk"}
            assert len({e["id"] for e in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
            assert joined(chunks, chat=True) == {j: words(5 + j, range(3)) for j in range(n)}
            for j in range(n):
                evs = choice_events(chunks, j)
                assert evs[0]["delta"] == {"role": "assistant", "content": f" s{5 + j}t0"}
                assert all("role" not in e["delta"] for e in evs[1:])  # D's role dropped
                assert [e["finish_reason"] for e in evs] == [None, None, "length"]
            assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3 * n, "total_tokens": 2 + 3 * n}

    run(go())


def test_first_tokens_reach_client_before_decode_answers() -> None:
    """Both choices' P tokens arrive while D still holds its answers: choices run concurrently, and P's token
    is not held back until D answers."""
    async def go() -> None:
        gate = asyncio.Event()
        async with stubs(gate=gate) as (ps, ds), proxy_over(ps, ds) as (url, _):
            body = {"prompt": "a b", "max_tokens": 3, "seed": 1, "n": 2, "stream": True}
            async with aiohttp.ClientSession() as s, s.post(url + CMPL, json=body) as r:
                first = [await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5) for _ in range(2)]
                assert not gate.is_set()  # D holds its answers until the gate opens
                got = {json.loads(f[len(b"data: "):])["choices"][0]["text"] for f in first}
                assert got == {" s1t0", " s2t0"}
                for _ in range(100):
                    if len(ds[0].bodies) == 2:
                        break
                    await asyncio.sleep(0.01)
                assert len(ds[0].bodies) == 2  # both D requests are waiting
                gate.set()
                rest = parse_sse((b"".join(first) + await r.read()).decode())
            assert joined(rest[:-1], chat=False) == {0: words(1, range(3)), 1: words(2, range(3))}
            assert rest[-1] == "[DONE]"

    run(go())


def test_prefill_ends_the_choice() -> None:
    """P's token meets a stop string (kv_transfer_params null): no D request for that choice."""
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            body = {"prompt": "a b", "max_tokens": 4, "seed": 7, "n": 2, "stop": [" s7t0"]}
            status, data = await post(url, body)
            assert status == 200, data
            c0, c1 = data["choices"]
            assert (c0["text"], c0["finish_reason"], c0["stop_reason"]) == ("", "stop", " s7t0")
            assert (c1["text"], c1["finish_reason"]) == (words(8, range(4)), "length")
            assert data["usage"] == {"prompt_tokens": 2, "completion_tokens": 1 + 4, "total_tokens": 7}
            assert [b["seed"] for b in ds[0].bodies] == [8]
            events = await stream(url, {**body, "n": 1, "stream": True})
            assert events == [{**events[0], "choices": [{"index": 0, "text": "", "logprobs": None,
                                                         "finish_reason": "stop", "stop_reason": " s7t0"}]}, "[DONE]"]
            assert len(ds[0].bodies) == 1

    run(go())


def test_decode_stop_string_finishes_the_choice() -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            status, data = await post(url, {"prompt": "a", "max_tokens": 8, "seed": 3, "stop": " s3t2"})
            assert status == 200
            c = data["choices"][0]
            assert (c["text"], c["finish_reason"], c["stop_reason"]) == (words(3, range(2)), "stop", " s3t2")
            assert data["usage"]["completion_tokens"] == 3

    run(go())


# ---- failures --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["error500", "drop"])
def test_failed_prefill_is_retried_on_another(mode: str) -> None:
    async def go() -> None:
        async with stubs(num_prefill=2) as (ps, ds), proxy_over(ps, ds) as (url, _):
            ps[0].mode = mode  # least-loaded, equal loads: the first pick is ps[0]
            status, data = await post(url, {"prompt": "a b c", "max_tokens": 3, "seed": 2})
            assert status == 200, data
            assert data["choices"][0]["text"] == words(2, range(3))
            assert len(ps[0].bodies) == len(ps[1].bodies) == 1
            assert ds[0].bodies[0]["kv_transfer_params"]["remote_port"] == ps[1].zmq_port
            assert await metric(url, "kvserve_proxy_prefill_retries_total") == 1
            kind = "prefill_http_5xx" if mode == "error500" else "prefill_connect"
            assert await metric(url, "kvserve_proxy_failures_total", kind=kind) == 1
            assert await metric(url, "kvserve_proxy_fallback_recompute_total") == 0

    run(go())


def test_unreachable_prefill_is_marked_unhealthy() -> None:
    async def go() -> None:
        async with stubs(num_prefill=2) as (ps, ds), proxy_over(ps, ds, metrics_interval_s=60) as (url, proxy):
            await ps[0].stop()  # the proxy still believes it healthy (no scrape for 60 s)
            for _ in range(2):
                status, data = await post(url, {"prompt": "a", "max_tokens": 2})
                assert status == 200 and data["choices"][0]["text"] == " t0 t1"
            assert [b.healthy for b in proxy.prefill.backends] == [False, True]
            assert len(ps[1].bodies) == 2
            assert await metric(url, "kvserve_proxy_prefill_retries_total") == 1  # the second skips it
            assert await metric(url, "kvserve_proxy_failures_total", kind="prefill_connect") == 1
            assert await metric(url, "kvserve_proxy_backend_healthy", role="prefill", url=ps[0].url) == 0

    run(go())


def test_no_prefill_left_recomputes_on_decode() -> None:
    async def go() -> None:
        async with stubs(num_prefill=2, mode="error500") as (ps, ds), proxy_over(ps, ds) as (url, _):
            ds[0].mode = "ok"
            status, data = await post(url, {"prompt": "a b c", "max_tokens": 4, "seed": 7, "n": 2})
            assert status == 200, data
            assert [c["text"] for c in data["choices"]] == [words(7, range(4)), words(8, range(4))]
            assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
            assert len(ds[0].bodies) == 2 and all("kv_transfer_params" not in b for b in ds[0].bodies)
            events = await stream(url, {"messages": USER, "max_tokens": 2, "stream": True,
                                        "stream_options": {"include_usage": True}}, CHAT)
            assert joined(events[:-1], chat=True) == {0: " t0 t1"}
            assert choice_events(events, 0)[0]["delta"] == {"role": "assistant", "content": ""}  # D's own opening
            assert events[-2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
            assert await metric(url, "kvserve_proxy_fallback_recompute_total") == 3
            assert len(ps[0].bodies) == len(ps[1].bodies) == 3

    run(go())


def test_prefill_without_transfer_params_counts_as_failed() -> None:
    """A P that is not a kv producer answers finish_reason "length" and no kv_transfer_params: D recomputes."""
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            ps[0].mode = "no_kv"
            status, data = await post(url, {"prompt": "a b", "max_tokens": 3})
            assert status == 200 and data["choices"][0]["text"] == " t0 t1 t2"
            assert "kv_transfer_params" not in ds[0].bodies[0]
            assert await metric(url, "kvserve_proxy_failures_total", kind="prefill_bad_response") == 1
            assert await metric(url, "kvserve_proxy_fallback_recompute_total") == 1

    run(go())


def test_timeouts_retry_prefill_and_end_decode_streams() -> None:
    async def go() -> None:
        async with stubs(num_prefill=2) as (ps, ds), proxy_over(ps, ds, request_timeout_s=0.3) as (url, _):
            ps[0].mode = "hang"
            status, data = await post(url, {"prompt": "a", "max_tokens": 2})
            assert status == 200 and data["choices"][0]["text"] == " t0 t1"
            assert await metric(url, "kvserve_proxy_failures_total", kind="prefill_timeout") == 1
            await asyncio.wait_for(ps[0].cancelled.wait(), 5)  # the proxy closed the connection
            ps[0].mode, ds[0].mode = "ok", "hang"
            events = await stream(url, {"prompt": "a", "max_tokens": 2, "stream": True})
            assert joined(events[:1], chat=False) == {0: " t0"} and events[-1] == "[DONE]"
            assert "did not answer within 0.3 s" in events[-2]["error"]["message"]
            assert await metric(url, "kvserve_proxy_failures_total", kind="decode_timeout") == 1

    run(go())


def test_unreachable_decode_is_skipped() -> None:
    """A D that refuses the connection never saw the request: the next D gets it (P's KV is still pinned)."""
    async def go() -> None:
        async with stubs(num_decode=2) as (ps, ds), proxy_over(ps, ds, metrics_interval_s=60) as (url, proxy):
            await ds[0].stop()
            events = await stream(url, {"prompt": "a", "max_tokens": 3, "stream": True})
            assert joined(events[:-1], chat=False) == {0: " t0 t1 t2"}
            assert len(ds[1].bodies) == 1 and [b.healthy for b in proxy.decode.backends] == [False, True]
            assert await metric(url, "kvserve_proxy_failures_total", kind="decode_connect") == 1
            assert ps[0].released == []

    run(go())


@pytest.mark.parametrize("streamed", [False, True])
def test_prefill_4xx_is_relayed(streamed: bool) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            status, data = await post(url, {"prompt": "a", "max_tokens": 5, "bogus": 1, "stream": streamed})
            assert status == 400
            assert data == {"error": {"message": "bogus: Extra inputs are not permitted",
                                      "type": "invalid_request_error", "param": "bogus", "code": 400}}
            assert ds[0].bodies == []

    run(go())


@pytest.mark.parametrize("mode", ["error500", "drop_mid_stream", "error_event"])
def test_decode_failure_is_an_error_event(mode: str) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            ds[0].mode = mode
            events = await stream(url, {"prompt": "a", "max_tokens": 4, "stream": True})
            assert events[0]["choices"][0]["text"] == " t0"
            assert events[-1] == "[DONE]" and set(events[-2]) == {"error"}
            err = events[-2]["error"]
            assert err["type"] == "server_error" and err["code"] == 503 and ds[0].url in err["message"]
            if mode == "error_event":
                assert err["message"].endswith("failed the request: stub engine failure")
            if mode == "drop_mid_stream":
                assert joined(events[:-2], chat=False) == {0: " t0 t1"}
            await asyncio.wait_for(ps[0].released_event.wait(), 5)  # nobody else frees P's blocks now
            assert ps[0].released == ["stub-p-1"]

    run(go())


def test_decode_failure_non_streamed_is_a_503() -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            ds[0].mode = "error500"
            status, data = await post(url, {"messages": USER, "max_tokens": 4}, CHAT)
            assert status == 503
            assert data["error"]["type"] == "server_error" and "500" in data["error"]["message"]
            assert await metric(url, "kvserve_proxy_failures_total", kind="decode_http_5xx") == 1
            await asyncio.wait_for(ps[0].released_event.wait(), 5)

    run(go())


BAD = [
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    (CMPL, {"prompt": "a", "echo": True}, "echo"),
    (CMPL, {"prompt": "a", "prompt_logprobs": 0}, "prompt_logprobs"),
    (CMPL, {"prompt": "a", "best_of": 2}, "best_of"),
    (CMPL, {"prompt": ["a", "b"]}, "prompt"),
    (CMPL, {"prompt": [[1, 2], [3]]}, "prompt"),
    (CMPL, {"prompt": "a", "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    (CMPL, b"[1, 2]", None),
    (CMPL, b"{not json", None),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[str(b[2]) + str(k) for k, b in enumerate(BAD)])
def test_refused_requests(path: str, body: Any, param: str | None) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            status, data = await post(url, body, path)
            assert status == 400
            assert data["error"]["type"] == "invalid_request_error" and data["error"]["param"] == param
            assert data["error"]["message"].startswith(param or "body")
            assert ps[0].bodies == ds[0].bodies == []
            assert await metric(url, "kvserve_proxy_failures_total", kind="invalid_request") == 1

    run(go())


def test_one_prompt_in_a_list_and_token_ids_are_accepted() -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            for prompt, tokens in (([1, 2, 3, 4], 4), (["a b"], 2)):
                body = {"prompt": prompt, "max_tokens": 2, "tools": [], "kv_transfer_params": None}
                status, data = await post(url, body)
                assert status == 200 and data["usage"]["prompt_tokens"] == tokens, data
                assert data["choices"][0]["text"] == " t0 t1"
            assert [b["kv_transfer_params"] for b in ps[0].bodies] == [{"do_remote_decode": True}] * 2
            assert all(b["kv_transfer_params"]["do_remote_prefill"] for b in ds[0].bodies)

    run(go())


# ---- client disconnects ----------------------------------------------------------------------------
@pytest.mark.parametrize("streamed", [True, False])
def test_client_disconnect_releases_and_cancels(streamed: bool) -> None:
    async def go() -> None:
        gate = asyncio.Event()  # never set: D holds every answer
        async with stubs(gate=gate) as (ps, ds), proxy_over(ps, ds) as (url, _):
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "a b", "max_tokens": 8, "stream": streamed}
                if streamed:
                    r = await s.post(url + CMPL, json=body)
                    first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
                    assert b'" t0"' in first
                    await asyncio.wait_for(ds[0].contacted.wait(), 5)
                    r.close()  # the client leaves
                else:
                    waiting = asyncio.ensure_future(s.post(url + CMPL, json=body))
                    await asyncio.wait_for(ds[0].contacted.wait(), 5)
                    waiting.cancel()  # the client leaves (its connection closes)
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiting
            await asyncio.wait_for(ps[0].released_event.wait(), 5)
            await asyncio.wait_for(ds[0].cancelled.wait(), 5)
            assert ps[0].released == ["stub-p-1"]
            for _ in range(50):
                if await metric(url, "kvserve_proxy_failures_total", kind="client_disconnect") == 1:
                    break
                await asyncio.sleep(0.02)
            assert await metric(url, "kvserve_proxy_failures_total", kind="client_disconnect") == 1

    run(go())


# ---- routing ---------------------------------------------------------------------------------------
def test_least_loaded_picks_the_smaller_load() -> None:
    async def go() -> None:
        async with stubs(num_prefill=2, num_decode=2) as (ps, ds):
            ps[0].running, ps[0].waiting = 3, 2
            ds[1].waiting = 1
            async with proxy_over(ps, ds, metrics_interval_s=0.05) as (url, proxy):
                for _ in range(3):
                    assert (await post(url, {"prompt": "a", "max_tokens": 2}))[0] == 200
                assert (len(ps[0].bodies), len(ps[1].bodies)) == (0, 3)
                assert (len(ds[0].bodies), len(ds[1].bodies)) == (3, 0)
                ps[0].running = ps[0].waiting = 0
                ps[1].running = 9
                for _ in range(100):
                    if proxy.prefill.backends[1].running == 9 and proxy.prefill.backends[0].load == 0:
                        break
                    await asyncio.sleep(0.02)
                assert (await post(url, {"prompt": "a", "max_tokens": 2}))[0] == 200
                assert (len(ps[0].bodies), len(ps[1].bodies)) == (1, 3)
                ps[1].running = 0
                for _ in range(100):
                    if proxy.prefill.backends[1].running == 0:
                        break
                    await asyncio.sleep(0.02)
                for _ in range(4):  # equal loads: in turn
                    assert (await post(url, {"prompt": "a", "max_tokens": 2}))[0] == 200
                assert (len(ps[0].bodies), len(ps[1].bodies)) == (3, 5)

    run(go())


def test_round_robin_ignores_load() -> None:
    async def go() -> None:
        async with stubs(num_prefill=2, num_decode=2) as (ps, ds):
            ps[0].running = ds[0].waiting = 100
            async with proxy_over(ps, ds, routing="round-robin") as (url, _):
                seen = []
                for _ in range(4):
                    assert (await post(url, {"prompt": "a", "max_tokens": 2}))[0] == 200
                    seen.append((len(ps[0].bodies), len(ps[1].bodies), len(ds[0].bodies), len(ds[1].bodies)))
                assert seen == [(1, 0, 1, 0), (1, 1, 1, 1), (2, 1, 2, 1), (2, 2, 2, 2)]

    run(go())


# ---- pass-through, health, models ------------------------------------------------------------------
@pytest.mark.parametrize(("path", "body"), [
    (CMPL, {"prompt": "a b", "max_tokens": 1, "n": 2, "seed": 3}),
    (CMPL, {"prompt": "a b", "max_tokens": 1, "seed": 3, "stream": True, "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": USER, "max_completion_tokens": 1, "max_tokens": 9, "seed": 3}),
])
def test_max_tokens_one_goes_to_prefill_as_is(path: str, body: dict[str, Any]) -> None:
    async def go() -> None:
        async with stubs() as (ps, ds), proxy_over(ps, ds) as (url, _):
            chat = path == CHAT
            if body.get("stream"):
                events = await stream(url, body, path)
                assert joined(events[:-1], chat) == {0: " s3t0"} and events[-1] == "[DONE]"
                assert events[-2]["usage"]["completion_tokens"] == 1
            else:
                status, data = await post(url, body, path)
                assert status == 200 and data["id"] == "stub-prefill"  # P's answer, relayed
                texts = [c["message"]["content"] if chat else c["text"] for c in data["choices"]]
                assert texts == [f" s{3 + j}t0" for j in range(body.get("n", 1))]
            assert ps[0].bodies == [body] and ds[0].bodies == []

    run(go())


def test_health_models_and_metrics() -> None:
    async def go() -> None:
        async with stubs(num_decode=2) as (ps, ds), proxy_over(ps, ds, metrics_interval_s=0.05) as (url, proxy):
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/health") as r:
                    assert r.status == 200
                async with s.get(url + "/v1/models") as r:
                    assert r.status == 200 and (await r.json())["data"][0]["owned_by"] == "stub-decode"
                for d in ds:
                    d.healthy = False
                for _ in range(100):
                    if not proxy.decode.any_healthy:
                        break
                    await asyncio.sleep(0.02)
                async with s.get(url + "/health") as r:
                    assert r.status == 503 and (await r.json())["error"]["code"] == 503
                async with s.get(url + "/v1/models") as r:
                    assert r.status == 503
                async with s.get(url + "/nowhere") as r:
                    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
                ds[1].healthy = True
                for _ in range(100):
                    if proxy.decode.any_healthy:
                        break
                    await asyncio.sleep(0.02)
                status, data = await post(url, {"prompt": "a", "max_tokens": 2})
                assert status == 200 and len(ds[1].bodies) == 1 and ds[0].bodies == []
            assert await metric(url, "kvserve_proxy_requests_total", endpoint="completions", path="split") == 1
            assert await metric(url, "kvserve_proxy_backend_healthy", role="decode", url=ds[0].url) == 0

    run(go())


# ---- the command -----------------------------------------------------------------------------------
def test_proxy_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["proxy", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--prefill", "--decode", "--host", "--port", "--routing", "--metrics-interval", "--request-timeout"):
        assert flag in out


GOOD = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", "--port", "8000"]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--decode", "http://127.0.0.1:8200", "--port", "8000"], "--prefill"),
    ([*GOOD, "--routing", "random"], "--routing"),
    ([*GOOD, "--metrics-interval", "soon"], "--metrics-interval"),
    ([*GOOD, "--bogus"], "--bogus"),
    (["--prefill", "127.0.0.1:8100", *GOOD[2:]], "prefill: '127.0.0.1:8100' is not a base URL"),
    (["--prefill", "http://a:1", "http://a:1/", *GOOD[2:]], "prefill: a URL is listed twice"),
    ([*GOOD, "--metrics-interval", "0"], "metrics_interval: must be a positive number"),
    ([*GOOD, "--request-timeout", "-1"], "request_timeout: must be a positive number"),
    ([*GOOD[:-1], "70000"], "port: 70000 is not in 1..65535"),
])
def test_bad_flags_exit_with_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code: Any
    try:
        code = main(["proxy", *argv])
    except SystemExit as e:
        code = e.code  # argparse's own errors
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and "error" in err[-1]
    # one line; an unknown flag is the top-level parser's (its one-line usage, then the error)
    assert len(err) == (2 if needle == "--bogus" else 1), err


def test_port_in_use_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--port", str(port)])
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: port: cannot listen on 127.0.0.1:{port}")


def test_proxy_sse_and_json_parse_match_python_json() -> None:
    from kvserve.disagg.proxy_http import json_or_none, sse

    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1796661890, "model": MODEL,
             "choices": [{"index": 0, "text": " Paris\u2028é ✓\x01\"\\\n", "logprobs": {
                 "tokens": [" Paris"], "token_logprobs": [-0.25], "top_logprobs": [{" Paris": -0.25, "x": -9999.0}]},
                 "finish_reason": None}], "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}
    encoded = sse(chunk)
    assert encoded == f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
    assert json_or_none(encoded[6:-2]) == chunk
    # what msgspec refuses and Python's json accepts still parses as json.loads does; non-JSON is None
    assert json_or_none(b'{"a": NaN, "b": 123456789012345678901234567890}')["b"] == 123456789012345678901234567890
    assert json_or_none(b"[DONE]") is None and json_or_none(b"\xff{") is None
