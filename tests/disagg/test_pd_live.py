"""Prefill/decode disaggregation end to end (issue 14): a prefill server (P), a decode server (D) and the
proxy as real processes on loopback ports, SmolLM2-135M in fp32, against a single server of the same model.

- Greedy through the proxy equals the single instance token for token, streamed and not, for prompts of
  one block (16 tokens), several blocks and a partial last block, with n = 2 and with a stop string.
- D computes none of the prompt (``prompt_tokens_computed_total`` unchanged) and receives exactly
  ``ceil(prompt / 16)`` blocks x the KV bytes per block that ``kvserve plan``'s arithmetic gives.
- After every request, after client aborts at random points, and after P is killed mid-transfer: no pinned
  or used blocks on either side, and every request completed or got a clean error.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_harness import MODEL, Server, free_port, is_idle, sse_events  # noqa: E402

from kvserve.planner.model_info import load_model_info  # noqa: E402

pytestmark = pytest.mark.slow
BS = 16
FP32 = ("--dtype", "float32", "--block-size", str(BS))


def _transfer(role: str, port: int, timeout_s: float = 30.0) -> tuple[str, str]:
    return ("--kv-transfer-config", json.dumps({"kv_connector": "ZmqConnector", "kv_role": role,
                                                "kv_ip": "127.0.0.1", "kv_port": port,
                                                "kv_transfer_timeout_s": timeout_s}))


class Proxy:
    """``kvserve proxy`` as a child process."""

    def __init__(self, prefill: list[str], decode: list[str], *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="kvserve-proxy-", suffix=".log")[1])
        self._f = self.log.open("wb")
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "proxy", "--prefill", *prefill, "--decode", *decode,
               "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._f.close()
        self.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def deployment() -> Iterator[dict[str, Any]]:
    single = Server(*FP32)
    p = Server(*FP32, *_transfer("kv_producer", free_port()))
    d = Server(*FP32, *_transfer("kv_consumer", free_port(), timeout_s=3.0))
    proxy = Proxy([p.url], [d.url], "--routing", "round-robin")
    try:
        yield {"single": single, "p": p, "d": d, "proxy": proxy}
    finally:
        proxy.stop()
        for s in (d, p, single):
            s.stop()


def _prompt(n_tokens: int) -> list[int]:
    rng = random.Random(n_tokens)
    return [rng.randrange(100, 40000) for _ in range(n_tokens)]


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", url + path, json={"model": MODEL, "temperature": 0, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        return sse_events(r.iter_lines())


def _streamed_text(events: list[Any], n: int) -> list[str]:
    texts = [""] * n
    for ev in events:
        if ev == "[DONE]":
            continue
        assert "error" not in ev, ev
        for ch in ev.get("choices") or []:
            texts[ch["index"]] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
    return texts


def _assert_clean(dep: dict[str, Any]) -> None:
    for name in ("p", "d"):
        m = dep[name].wait_for(lambda m: is_idle(m) and m["kvserve:kv_transfer_pinned_blocks"] == 0, 10)
        assert is_idle(m) and m["kvserve:kv_transfer_pinned_blocks"] == 0, (name, m)


@pytest.mark.parametrize("n_tokens", [16, 50, 64])
def test_proxy_equals_single_instance(deployment: dict[str, Any], n_tokens: int) -> None:
    single, d, proxy = deployment["single"], deployment["d"], deployment["proxy"]
    prompt = _prompt(n_tokens)
    body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True}
    ref = _complete(single.url, body)
    m0 = d.metrics()
    got = _complete(proxy.url, body)
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] == 12
    assert got["usage"]["prompt_tokens"] == n_tokens
    m1 = d.metrics()
    assert m1["kvserve:prompt_tokens_computed_total"] == m0["kvserve:prompt_tokens_computed_total"]
    # KV bytes per token: layers x 2 (K, V) x kv heads x head dim x 4 bytes (fp32), as kvserve plan computes
    per_token = load_model_info(MODEL).arch.kv_bytes_per_token(4)
    pulled = m1["kvserve:kv_transfer_bytes_received_total"] - m0["kvserve:kv_transfer_bytes_received_total"]
    assert pulled == -(-n_tokens // BS) * BS * per_token
    # streamed: the same text, P's token first
    events = _stream(proxy.url, "/v1/completions", body)
    assert _streamed_text(events, 1) == [ref["choices"][0]["text"]]
    _assert_clean(deployment)


def test_proxy_n2_stop_string_and_chat(deployment: dict[str, Any]) -> None:
    single, proxy = deployment["single"], deployment["proxy"]
    body: dict[str, Any] = {"prompt": "The capital of France is", "max_tokens": 24, "n": 2}
    ref = _complete(single.url, body)
    got = _complete(proxy.url, body)
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in ref["choices"]]
    assert got["usage"] == {k: v for k, v in ref["usage"].items() if k in got["usage"]}
    words = ref["choices"][0]["text"].split()
    stop = words[len(words) // 2]
    ref = _complete(single.url, {**body, "n": 1, "stop": [stop]})
    assert _complete(proxy.url, {**body, "n": 1, "stop": [stop]})["choices"][0]["text"] == ref["choices"][0]["text"]
    assert _streamed_text(_stream(proxy.url, "/v1/completions", {**body, "stop": [stop]}), 2) == \
        [ref["choices"][0]["text"]] * 2
    chat = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 20}
    r = httpx.post(single.url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0, **chat}, timeout=60)
    want = r.json()["choices"][0]["message"]["content"]
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0, **chat}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    assert _streamed_text(_stream(proxy.url, "/v1/chat/completions", chat), 1) == [want]
    _assert_clean(deployment)


def test_client_aborts_leave_no_blocks(deployment: dict[str, Any]) -> None:
    proxy = deployment["proxy"]
    rng = random.Random(7)
    for i in range(8):
        body = {"model": MODEL, "prompt": _prompt(40 + 7 * i), "max_tokens": 40, "ignore_eos": True,
                "stream": True, "temperature": 0}
        read = rng.randrange(0, 6)  # events to read before hanging up (0: right after the headers)
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
            for k, _ in enumerate(r.iter_lines()):
                if k >= read:
                    break
        time.sleep(rng.random() * 0.2)
    _assert_clean(deployment)


def test_killing_prefill_mid_transfer(deployment: dict[str, Any]) -> None:
    """P dies while D pulls (a P that answers pulls only after a delay): D recomputes; nothing leaks."""
    single, d = deployment["single"], deployment["d"]
    p_port = free_port()
    os.environ["KVSERVE_TEST_KV_SERVE_DELAY_S"] = "2"
    try:
        p = Server(*FP32, *_transfer("kv_producer", p_port))
    finally:
        del os.environ["KVSERVE_TEST_KV_SERVE_DELAY_S"]
    proxy = Proxy([p.url], [d.url])
    try:
        body = {"prompt": _prompt(48), "max_tokens": 10, "ignore_eos": True}
        ref = _complete(single.url, body)
        m0 = d.metrics()
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(_complete(proxy.url, body)))
        t.start()
        time.sleep(1.0)  # P answered the token; D is waiting for the pull
        p.proc.kill()
        t.join(60)
        assert result["choices"][0]["text"] == ref["choices"][0]["text"]
        m1 = d.wait_idle()
        key = "kvserve:kv_transfer_recomputed_requests_total"
        assert m1[key] == m0[key] + 1
        assert is_idle(m1)
    finally:
        proxy.stop()
        p.stop()
