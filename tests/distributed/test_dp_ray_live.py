"""Data parallelism on a real 2-node Ray cluster (ray_cluster.py: the head on the host, a worker node in a
network namespace over a veth pair): ``kvserve serve --data-parallel-size 2 --ray-address ...`` with one
SmolLM2-135M replica per node (strict-spread placement, 1 CPU per node), the router in the serving process.

- completions and streams are served; distinct prefixes are split across the two replicas (nodes); a
  repeated prefix goes to the replica that has it (``cached_tokens`` > 0 on the repeat, there);
- killing a replica mid-run (SIGKILL): every request that had not streamed a token completes on the
  survivor, the streams that had end with an error event and ``[DONE]``, new requests all succeed, and the
  survivor holds no KV block once idle.
"""

from __future__ import annotations

import os
import re
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from ray_cluster import HOST_IP, NS_IP, two_node_cluster, unavailable_reason  # noqa: E402
from server_harness import MODEL, free_port, is_idle, parse_metrics, sse_events  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable_reason() is not None,
                                                   reason=f"2-node Ray cluster: {unavailable_reason()}")]
_REPLICA_LINE = re.compile(r"replica (\d) on (http://[0-9.]+:\d+) \(node ([0-9.]+), pid (\d+)\)")


class Deployment:
    """``kvserve serve --data-parallel-size 2`` on the cluster, as a child process."""

    def __init__(self, address: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="kvserve-dp-", suffix=".log")[1])
        self._f = self.log.open("wb")
        cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
               "--port", str(self.port), "--data-parallel-size", "2", "--distributed-executor-backend", "ray",
               "--ray-address", address, "--data-parallel-placement", "strict-spread", "--num-threads", "1",
               "--kv-cache-memory", "0.2", "--dtype", "float32", "--health-check-interval", "0.5",
               "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--disable-log-requests"]
        self.proc = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT, env=env)
        self.replicas: dict[str, tuple[str, int]] = {}  # url -> (node ip, pid)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text()[-5000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            raise TimeoutError(self.log.read_text()[-5000:])
        for m in _REPLICA_LINE.finditer(self.log.read_text()):
            self.replicas[m.group(2)] = (m.group(3), int(m.group(4)))

    def router_metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._f.close()
        self.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    with two_node_cluster(cpus_per_node=1) as cluster:
        dep = Deployment(cluster.address, cluster.env)
        try:
            yield dep
        finally:
            dep.stop()


def _system(tenant: int) -> str:
    return f"You are assistant number {tenant}. " + " ".join(f"Rule {k}: answer briefly and politely."
                                                             for k in range(12))


def _complete(url: str, prompt: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, **extra}, timeout=180)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _requests_by_replica(dep: Deployment) -> dict[str, float]:
    return {u: dep.router_metric("kvserve_router_replica_requests_total", url=u) for u in dep.replicas}


def test_dp2_across_two_nodes_serves_and_routes_by_prefix(deployment: Deployment) -> None:
    dep = deployment
    assert sorted(ip for ip, _ in dep.replicas.values()) == [HOST_IP, NS_IP]  # one replica per node
    out = _complete(dep.url, "The capital of France is", max_tokens=8)
    assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] == 8
    with httpx.stream("POST", dep.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
                            "stream": True, "temperature": 0}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    assert "".join((e["choices"][0]["delta"].get("content") or "") for e in events[:-1] if e["choices"])
    # bad input: the replica's 4xx, relayed
    r = httpx.post(dep.url + "/v1/completions", content=b'{"prompt": ', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    r = httpx.post(dep.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    # distinct prefixes split across the replicas (one per node)
    before = _requests_by_replica(dep)
    for tenant in range(4):
        _complete(dep.url, _system(tenant) + " Question: what is 1 + 1?")
    after = _requests_by_replica(dep)
    assert all(after[u] - before[u] == 2 for u in dep.replicas), (before, after)
    # a repeated prefix goes to the replica that has it, and hits its prefix cache there
    for tenant in range(4):
        before = _requests_by_replica(dep)
        out = _complete(dep.url, _system(tenant) + " Question: name a colour.")
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64, out["usage"]
        after = _requests_by_replica(dep)
        assert sum(after[u] - before[u] for u in dep.replicas) == 1
    assert dep.router_metric("kvserve_router_requests_total", reason="prefix") >= 4


def test_killing_a_replica_loses_no_unstarted_request_and_leaks_no_block(deployment: Deployment) -> None:
    dep = deployment
    victim_url = next(u for u, (ip, _) in dep.replicas.items() if ip == NS_IP)
    survivor_url = next(u for u in dep.replicas if u != victim_url)
    results: dict[str, Any] = {}
    first_token = threading.Event()

    def plain(k: int) -> None:
        try:
            results[f"plain{k}"] = _complete(dep.url, _system(10 + k) + " Tell a story.", max_tokens=40,
                                             ignore_eos=True)["usage"]["completion_tokens"]
        except AssertionError as e:
            results[f"plain{k}"] = e

    def streamed(k: int) -> None:
        body = {"model": MODEL, "prompt": _system(20 + k) + " Count to ten.", "max_tokens": 40, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", dep.url + "/v1/completions", json=body, timeout=180) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith("data: {") and '"text"' in line:
                    first_token.set()
            results[f"stream{k}"] = (r.status_code, sse_events(lines))

    threads = [threading.Thread(target=plain, args=(k,)) for k in range(6)]
    threads += [threading.Thread(target=streamed, args=(k,)) for k in range(4)]
    retries0 = dep.router_metric("kvserve_router_retries_total")
    for t in threads:
        t.start()
    assert first_token.wait(120)
    deadline = time.monotonic() + 30
    while dep.router_metric("kvserve_router_replica_inflight", url=victim_url) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    inflight = dep.router_metric("kvserve_router_replica_inflight", url=victim_url)
    os.kill(dep.replicas[victim_url][1], signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert inflight >= 1
    for k in range(6):  # not streamed: all retried on the survivor if they were on the victim
        assert results[f"plain{k}"] == 40, results[f"plain{k}"]
    broken = 0
    for k in range(4):
        status, events = results[f"stream{k}"]
        assert status == 200 and events[-1] == "[DONE]"
        errors = [e for e in events[:-1] if "error" in e]
        assert not errors or (len(errors) == 1 and events[-2] is errors[0] and errors[0]["error"]["code"] == 503)
        broken += bool(errors)
        if not errors:
            assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1] if e.get("choices")) >= 1
    assert dep.router_metric("kvserve_router_failures_total", kind="stream_broken") == broken
    retried = dep.router_metric("kvserve_router_retries_total") - retries0
    print(f"victim in flight at the kill: {inflight:g}; retried: {retried:g}; streams ended by an error: {broken}")
    assert retried >= 1
    assert dep.router_metric("kvserve_router_replica_healthy", url=victim_url) == 0
    # new requests never reach it, and all succeed
    for tenant in range(3):
        _complete(dep.url, _system(tenant) + " One more question.")
    # the survivor ends idle with no KV block in use
    deadline = time.monotonic() + 20
    m = parse_metrics(httpx.get(survivor_url + "/metrics", timeout=10).text)
    while not is_idle(m) and time.monotonic() < deadline:
        time.sleep(0.1)
        m = parse_metrics(httpx.get(survivor_url + "/metrics", timeout=10).text)
    assert is_idle(m), m
