"""``kvserve serve --data-parallel-size 2`` without ``--ray-address``: a local Ray cluster started on 127.0.0.1
for the deployment and shut down with it. Two replicas of a tiny random-weight Qwen2 (no tokenizer: prompts
are token ids), round-robin: both serve, and at exit no process the deployment started is left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_harness import free_port, sse_events  # noqa: E402
from test_kv_offload import _save_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.skipif(not (Path(sys.executable).parent / "ray").exists(), reason="needs Ray")


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in (Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]).lower()
    except OSError:
        return False


def test_local_cluster_on_loopback_serves_and_is_shut_down(tmp_path: Path) -> None:
    model = _save_tiny_qwen2(tmp_path / "tiny", seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkstemp(prefix="kvserve-dp-local-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", str(model), "--skip-tokenizer-init",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "2",
           "--num-threads", "1", "--kv-cache-memory", "0.01", "--policy", "round-robin",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--disable-log-requests"]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.getcwd()})
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        replicas = re.findall(r"replica \d on (http://[0-9.]+:\d+) \(node ([0-9.]+)", log.read_text())
        assert len(replicas) == 2 and all(ip == "127.0.0.1" and u.startswith("http://127.0.0.1:")
                                          for u, ip in replicas), log.read_text()[-3000:]
        started = _descendants(proc.pid)
        for k in range(4):  # round-robin: two on each replica
            r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7, 8 + k], "max_tokens": 4,
                                                          "ignore_eos": True, "temperature": 0}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": [9, 10, 11], "max_tokens": 3, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3
        for u, _ in replicas:
            text = httpx.get(u + "/metrics", timeout=10).text
            assert re.search(r'kvserve:generation_tokens_total\{[^}]*\} (\d+)', text), text[:500]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            text = log.read_text()
            log.unlink(missing_ok=True)
    assert rc == 0, text[-3000:]
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in started if _alive(p)], "processes of the local Ray cluster outlived the deployment"
