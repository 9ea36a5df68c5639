"""``kvserve router`` over stub replicas (tests/disagg/proxy_stubs.py, role ``decode``: a plain OpenAI server
with known outputs): relaying, prefix affinity, salts, load, round-robin, retries of requests that had not
streamed a token when their replica died, clean ends of those that had, health, 4xx and 503s, the command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.distributed.router import Router, serve_router
from kvserve.distributed.router_cli import RouterConfig
from kvserve.distributed.router_pool import RoutingConfig
from kvserve.entrypoints.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from proxy_stubs import MODEL, Stub  # noqa: E402

T = TypeVar("T")
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
INTERVAL = 0.1  # health-check period of these tests (s)


def run(coro: Awaitable[T], timeout: float = 30.0) -> T:
    async def go() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(go())


def prompt(tenant: int, question: int = 0) -> str:
    """A 3-block shared prefix per ``tenant`` (64-character blocks), then a question."""
    return f"system prompt of tenant {tenant:03d} " * 7 + f"question {question}"


@contextlib.asynccontextmanager
async def replicas(n: int = 2) -> AsyncIterator[list[Stub]]:
    out = [Stub("decode", shutdown_timeout_s=0.1) for _ in range(n)]  # stop(): the replica dies at once
    async with contextlib.AsyncExitStack() as stack:
        for s in out:
            await stack.enter_async_context(s.serve())
        yield out


@contextlib.asynccontextmanager
async def router_over(stubs: list[Stub], policy: str = "cache-aware") -> AsyncIterator[tuple[str, Router]]:
    cfg = RouterConfig.from_urls([s.url for s in stubs], routing=RoutingConfig(policy=policy),
                                 health_check_interval_s=INTERVAL)
    async with serve_router(cfg) as (url, router):
        yield url, router


async def post(url: str, body: Any, path: str = CMPL) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def stream(url: str, body: dict[str, Any], path: str = CMPL) -> tuple[int, list[Any]]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json={**body, "stream": True}) as r:
        text = await r.text()
        if r.content_type != "text/event-stream":
            return r.status, [json.loads(text)]
    events = [b[len("data: "):] for b in text.split("\n\n") if b.startswith("data: ")]
    return r.status, [e if e == "[DONE]" else json.loads(e) for e in events]


async def metric(base: str, name: str, **labels: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def owner(stubs: list[Stub], text: str) -> list[int]:
    """Which stubs saw a request whose prompt starts with ``text``."""
    return [i for i, s in enumerate(stubs) for b in s.bodies if str(b.get("prompt", "")).startswith(text)]


def test_relays_completions_chat_streams_and_models() -> None:
    async def go() -> None:
        async with replicas() as stubs, router_over(stubs) as (url, _):
            status, data = await post(url, {"model": MODEL, "prompt": "a b c", "max_tokens": 3, "seed": 5})
            assert status == 200 and data["choices"][0]["text"] == " s5t0 s5t1 s5t2"
            assert data["usage"]["prompt_tokens"] == 3
            status, events = await stream(url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2}, CHAT)
            assert status == 200 and events[-1] == "[DONE]"
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == " t0 t1"
            async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["id"] == MODEL
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                assert r.status == 200
            # a replica's 4xx comes back as it is, and is not retried
            status, data = await post(url, {"model": MODEL, "prompt": "x", "bogus": 1})
            assert status == 400 and data["error"]["param"] == "bogus"
            assert sum(len(s.bodies) for s in stubs) == 3
            assert await metric(url, "kvserve_router_retries_total") == 0

    run(go())


def test_prefix_affinity_salts_and_split() -> None:
    async def go() -> None:
        async with replicas() as stubs, router_over(stubs) as (url, _):
            for tenant in range(4):  # four new prefixes: spread over both replicas
                assert (await post(url, {"model": MODEL, "prompt": prompt(tenant), "max_tokens": 1}))[0] == 200
            homes = [owner(stubs, prompt(t)[:150]) for t in range(4)]
            assert sorted(h[0] for h in homes) == [0, 0, 1, 1]
            for question in range(1, 4):  # a repeated prefix goes where it went before
                for tenant in range(4):
                    body = {"model": MODEL, "prompt": prompt(tenant, question), "max_tokens": 1}
                    assert (await post(url, body))[0] == 200
            assert all(len(set(owner(stubs, prompt(t)[:150]))) == 1 for t in range(4))
            assert await metric(url, "kvserve_router_requests_total", reason="prefix") == 12
            # the same prompt under two salts: never matched across tenants (the second goes by load)
            for salt in ("tenant-x", "tenant-y"):
                body = {"model": MODEL, "prompt": prompt(99), "max_tokens": 1, "cache_salt": salt}
                assert (await post(url, body))[0] == 200
            assert await metric(url, "kvserve_router_requests_total", reason="prefix") == 12
            assert sorted(owner(stubs, prompt(99)[:150])) == [0, 1]
            for salt in ("tenant-x", "tenant-y"):  # each salt sticks to its own replica
                body = {"model": MODEL, "prompt": prompt(99, 1), "max_tokens": 1, "cache_salt": salt}
                assert (await post(url, body))[0] == 200
            seen = {salt: {i for i, s in enumerate(stubs) for b in s.bodies if b.get("cache_salt") == salt}
                    for salt in ("tenant-x", "tenant-y")}
            assert all(len(v) == 1 for v in seen.values()) and seen["tenant-x"] != seen["tenant-y"]
            hit = await metric(url, "kvserve_router_prefix_hit_blocks_total")
            assert hit == 14 * 3  # 12 + 2 repeats of a 3-block prefix

    run(go())


def test_load_overrides_affinity_and_round_robin() -> None:
    async def go() -> None:
        async with replicas() as stubs, router_over(stubs) as (url, _):
            assert (await post(url, {"model": MODEL, "prompt": prompt(1), "max_tokens": 1}))[0] == 200
            home = owner(stubs, prompt(1))[0]
            stubs[home].running = 30  # scraped from its /metrics within a period
            await asyncio.sleep(3 * INTERVAL)
            assert (await post(url, {"model": MODEL, "prompt": prompt(1, 1), "max_tokens": 1}))[0] == 200
            assert owner(stubs, prompt(1, 1)) == [1 - home]
            assert await metric(url, "kvserve_router_requests_total", reason="balance") == 1
        async with replicas() as stubs, router_over(stubs, "round-robin") as (url, _):
            for _ in range(6):
                assert (await post(url, {"model": MODEL, "prompt": prompt(2), "max_tokens": 1}))[0] == 200
            assert [len(s.bodies) for s in stubs] == [3, 3]

    run(go())


def test_dead_replica_requests_retried_or_ended_cleanly_and_it_returns() -> None:
    async def go() -> None:
        async with replicas() as stubs, router_over(stubs, "round-robin") as (url, _):
            victim, survivor = stubs
            victim.mode = "hang"  # accepts requests and never answers: nothing streamed yet
            bodies = [{"model": MODEL, "prompt": prompt(t), "max_tokens": 2, "seed": t} for t in range(6)]
            tasks = [asyncio.ensure_future(post(url, b)) for b in bodies[:3]]
            tasks += [asyncio.ensure_future(stream(url, b)) for b in bodies[3:]]
            while len(victim.bodies) < 3:
                await asyncio.sleep(0.01)
            await victim.stop()  # the replica dies with its requests in flight
            results = await asyncio.gather(*tasks)
            for (status, data), body in zip(results[:3], bodies[:3], strict=True):  # none lost
                assert status == 200 and data["choices"][0]["text"] == f" s{body['seed']}t0 s{body['seed']}t1"
            for status, events in results[3:]:
                assert status == 200 and events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
            assert await metric(url, "kvserve_router_retries_total") == 3
            assert await metric(url, "kvserve_router_replica_healthy", url=victim.url) == 0
            # new requests never reach it
            for t in range(4):
                assert (await post(url, {"model": MODEL, "prompt": prompt(t), "max_tokens": 1}))[0] == 200
            assert await metric(url, "kvserve_router_retries_total") == 3
            # a replica that dies after streaming tokens: an error event, then [DONE]
            survivor.mode = "drop_mid_stream"
            status, events = await stream(url, {"model": MODEL, "prompt": "a b", "max_tokens": 5})
            assert status == 200 and events[0]["choices"][0]["text"] == " t0"
            assert events[-2]["error"]["code"] == 503 and events[-1] == "[DONE]"
            survivor.mode = "ok"
            # it comes back on the same port: healthy within a period, and in the rotation again
            port = int(victim.url.rsplit(":", 1)[1])
            back = Stub("decode", shutdown_timeout_s=0.1)
            async with back.serve(port):
                await asyncio.sleep(3 * INTERVAL)
                assert await metric(url, "kvserve_router_replica_healthy", url=back.url) == 1
                for t in range(4):
                    assert (await post(url, {"model": MODEL, "prompt": prompt(t), "max_tokens": 1}))[0] == 200
                assert len(back.bodies) == 2
                # a 5xx is retried on the other replica (round-robin: one of the two goes to the 5xx first)
                survivor.mode = "error500"
                for t in range(2):
                    status, data = await post(url, {"model": MODEL, "prompt": prompt(t), "max_tokens": 1})
                    assert status == 200, data
                assert len(back.bodies) == 4
                assert await metric(url, "kvserve_router_retries_total") == 4
                assert await metric(url, "kvserve_router_failures_total", kind="replica_http_5xx") == 1

    run(go())


def test_no_replica_alive_is_a_503_in_openai_shape() -> None:
    async def go() -> None:
        async with replicas(1) as stubs, router_over(stubs) as (url, _):
            await stubs[0].stop()
            status, data = await post(url, {"model": MODEL, "prompt": "x"})
            assert status == 503 and set(data["error"]) == {"message", "type", "param", "code"}
            status, events = await stream(url, {"model": MODEL, "prompt": "x"})
            assert status == 503 and events[0]["error"]["code"] == 503
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                assert r.status == 503
            assert await metric(url, "kvserve_router_failures_total", kind="unavailable") == 2

    run(go())


def test_command_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--replica", "not-a-url", "--port", "8000"]) == 2
    assert "replica" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["router", "--replica", "http://127.0.0.1:1", "--port", "8000", "--policy", "random"])
    assert e.value.code == 2
    assert main(["router", "--replica", "http://127.0.0.1:1", "--port", "8000", "--cache-threshold", "2"]) == 2
    assert "cache_threshold" in capsys.readouterr().err


def test_serve_refuses_bad_data_parallel_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before Ray or a model starts."""
    assert main(["serve", "--data-parallel-size", "2", "--distributed-executor-backend", "mp"]) == 2
    assert "distributed_executor_backend" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "data_parallel_size" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "2", "--max-waiting-requests", "-1"]) == 2
    assert "max_waiting_requests" in capsys.readouterr().err
